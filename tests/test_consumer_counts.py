"""A receipt is checked against the shim's byte counts: the consumer node waits for counts
newer than the receipt request, unless none can come.

In-process: a consumer node's ``Runtime`` (a real py-libp2p host on loopback) and
``Consumer``; the shim's reports are handed to it as the control channel would.
"""

import trio

from cumulus_p2p.dht.node import MeshConfig
from cumulus_p2p.market.settlement import ReceiptDesk
from cumulus_p2p.node import control
from cumulus_p2p.node.consumer import Consumer, ConsumerOptions
from cumulus_p2p.node.datadir import DataDir
from cumulus_p2p.node.runtime import open_runtime

OPTIONS = ConsumerOptions(command=("job.py",), max_price=1_000_000, match_timeout=20)
CONFIG = MeshConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))


async def test_a_receipt_request_waits_for_the_shims_next_report(tmp_path):
    data = DataDir(tmp_path / "consumer")
    async with open_runtime(data.identity(), data, CONFIG) as runtime:
        consumer = Consumer(runtime, OPTIONS, ReceiptDesk(data.identity(), data.ledger()))
        consumer.take_usage(control.Usage({"L1": 10}))  # before the request: not newer
        async with trio.open_nursery() as nursery:
            waited = trio.Event()

            async def request() -> None:
                await consumer.fresh_counts()
                waited.set()

            nursery.start_soon(request)
            await trio.sleep(0.2)
            assert not waited.is_set()
            consumer.take_usage(control.Usage({"L1": 20}))
            with trio.fail_after(1):
                await waited.wait()


async def test_after_the_shims_final_counts_a_receipt_request_waits_for_nothing(tmp_path):
    data = DataDir(tmp_path / "consumer")
    async with open_runtime(data.identity(), data, CONFIG) as runtime:
        consumer = Consumer(runtime, OPTIONS, ReceiptDesk(data.identity(), data.ledger()))
        # The shim closed its session (the host then asks for its last receipt) and gave
        # its final counts; the script's process has not exited yet.
        consumer.take_usage(control.Usage({"L1": 30}, final=True))
        with trio.fail_after(0.2):  # not the 2 s wait for a report that will never come
            await consumer.fresh_counts()
        assert consumer.exit_code is None
