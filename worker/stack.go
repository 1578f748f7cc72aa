package worker

// A job's goroutine starts, as every goroutine does, with a 2 KiB stack,
// and an effect's publish goes deeper than 4 KiB: through the handler,
// Job.Publish and the NATS client's publish. The runtime grows a stack by
// copying it to one twice the size, walking every frame on it to adjust
// its pointers, and that walk, done in the middle of the first publish
// with a dozen frames on the stack, cost about 3 µs a job: about 4% of
// the CPU of BenchmarkPipelineAlone/leasehold. growStack grows the stack
// to 8 KiB once, at the goroutine's start, when the walk has only its
// first frame to adjust.

// stackRoom is what growStack takes: more than a 4 KiB stack holds, so
// the runtime grows a 2 KiB one to 8 KiB in one step.
const stackRoom = 5 << 10

// growStack grows its caller's stack to 8 KiB (see above).
//
//go:noinline
func growStack() {
	var room [stackRoom]byte
	touch(&room)
}

// touch keeps room on growStack's frame: the compiler cannot drop what a
// call it does not inline is given.
//
//go:noinline
func touch(*[stackRoom]byte) {}
