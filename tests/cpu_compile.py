"""The compile option of the tests' programs that run on the CPU: :data:`UNOPTIMIZED` turns LLVM's backend
optimizations off, which takes about a third off XLA:CPU's compile time; the tiny programs then run in no time.

Only for programs whose checks hold under any compile: error bounds far above f32 round-off, statistical bounds,
ratios of losses, correctly rounded results and bit patterns, or runs of one executable compared with each other.
Never for two different programs compared bit for bit, unless their equality holds by construction under any compile
(the fused AdamW step against its twin: element-wise math rounded where it is written); elsewhere LLVM's FMA
contraction and vector widths change the last bits (the warp-specialized and single-warpgroup attention forwards
then differ by an ulp on a quarter of O). Never for the deviceless GPU/TPU compiles, whose checks (spills, memory,
kernel names) are of the optimized program."""

UNOPTIMIZED = {"xla_backend_optimization_level": 0}
