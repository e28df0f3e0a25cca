// The other half of the device library's unity build: see device_core.cpp.
#include "shapes.cpp"
#include "autocast.cpp"
#include "attention.cpp"
#include "dropout.cpp"
