// The executor's replay library as one translation unit (a unity build, as
// device_core.cpp explains): replay.cpp and program.cpp share most of torch's headers
// they need, so one compile parses them once, at half the CPU time of two.
#include "replay.cpp"
#include "program.cpp"
