"""Lab: copy a source tree into .lab/<dst> with per-phase stamps in tree_deltanet_item (thread 0 of each block:
clock64 and globaltimer into the module global lab_stamps[mode][block][i])."""
import shutil, subprocess, sys
src, dst = sys.argv[1], sys.argv[2]
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst, ignore=shutil.ignore_patterns('.lab', '.git', '.venv', 'results', 'docs', 'build', '.wheels', '__pycache__'))
p = f"{dst}/templates/tree.cuh"
s = open(p).read()
macro = '''
__device__ unsigned long long lab_stamps[3][512][16][2];
#define LAB_STAMP(i) do { if (threadIdx.x == 0) { unsigned long long g_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_)); \\
    auto* e_ = lab_stamps[mode][blockIdx.x + gridDim.x * blockIdx.y][i]; e_[0] = clock64(); e_[1] = g_; } } while (0)
'''
s = s.replace("namespace lucegen {\n", macro + "namespace lucegen {\n", 1)
def ins(anchor, text, after=True, must=True):
    global s
    if anchor not in s:
        assert not must, anchor
        return
    assert s.count(anchor) == 1, anchor
    s = s.replace(anchor, anchor + text if after else text + anchor)
ins("    const bool commit = mode != 0;\n", "    LAB_STAMP(0);\n")
new = "tree_deltanet_stage" in s
if new:
    ins("    if (mode != 2) wait_for_prior_grids();\n", "    LAB_STAMP(1);\n", after=False)
    ins("    if (mode != 2) wait_for_prior_grids();\n", "    LAB_STAMP(2);\n")
    ins("% K : -1, w, fronts, gates);\n", "    LAB_STAMP(4);\n")  # a decode step's fronts are made in the stage
    ins("        tree_deltanet_fronts<M, THREADS>(raw, taps, steps, w, fronts, gates);\n", "        LAB_STAMP(5);\n", after=False)
    ins("        tree_deltanet_fronts<M, THREADS>(raw, taps, steps, w, fronts, gates);\n    }\n    __syncthreads();\n", "    LAB_STAMP(6);\n")
else:
    ins("    const int start = tree_start(T.io, T.start);\n", "    LAB_STAMP(2);\n", after=False)
    ins("        slots[s] = pos % K;\n    }\n    __syncthreads();\n", "    LAB_STAMP(5);\n")
    ins("ring_slot, u0);\n    __syncthreads();\n", "    LAB_STAMP(6);\n")
ins("deltanet_load_state<M, THREADS>(S, state, start > 0);  // first: the latency overlaps the fronts\n    __syncthreads();\n", "    LAB_STAMP(3);\n")
ins("        if (lane == 0) sums[task] = ss;\n    }\n    __syncthreads();\n", "    LAB_STAMP(7);\n")
ins("sums[2 * s + 1]);\n    __syncthreads();\n", "    LAB_STAMP(8);\n")
ins("    if (commit)\n#pragma unroll\n", "    LAB_STAMP(9);\n", after=False)
ins("    // The gated RMSNorm of the nodes' outputs", "    LAB_STAMP(10);\n", after=False)
ins("}\n\nstruct TreeAttention {", "    LAB_STAMP(11);\n", after=False)
open(p, "w").write(s)
print("stamped", dst, "new" if new else "base")
