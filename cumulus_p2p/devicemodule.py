"""What ``torch.cumulus`` answers alike on both cumulus devices, the Python one
(``remote/device.py``) and the native one (``native/__init__.py``): a session exposes
one device, initialised once attached, and only the open session answers what it is
and waits for its ops. Each device's module says how it finds that session.

It imports nothing at import, so the native device's module (which must not import the
Python device) and the Python device's can both build on it.
"""

from __future__ import annotations


class SessionDeviceModule:
    """The part of a ``torch.cumulus`` module that both devices share."""

    @staticmethod
    def _open_session():
        """The device's open session; raises ``SessionClosedError`` if there is none."""
        raise NotImplementedError

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def get_amp_supported_dtype() -> list:
        import torch

        return [torch.float16, torch.bfloat16]

    @classmethod
    def session_info(cls) -> dict:
        """What the executor said of itself when the session opened."""
        return cls._open_session().info

    @classmethod
    def get_device_name(cls, device=None) -> str:
        return f"cumulus ({cls._open_session().info.get('device_name', '?')})"

    @classmethod
    def synchronize(cls, device=None) -> None:
        """Wait for every op sent so far; raises the executor's first failure."""
        cls._open_session().synchronize()
