// The device library is compiled as two translation units ("unity builds"), this one
// and device_ops.cpp, each including its share of the sources: torch's headers, which
// are most of each source's compile time, are then parsed twice rather than nine times
// (the whole native build, this library and the replay loop's: 53 s on 2 cores, against
// 79 s file by file). The two halves take about as long, so ninja keeps both cores busy.
// A source added to the device goes in one of them; names private to a source must not
// clash with another's in its half.
#include "record.cpp"
#include "device.cpp"
#include "kernels.cpp"
#include "graphs.cpp"
#include "module.cpp"
