#!/usr/bin/env python3
"""Builds the CPU version of one CUDA kernel module (a `.cu` file) for the emulated device: a shared library whose
table `cuemu_module_kernels` lists its kernels.

    kernelize.py SOURCE.cu OUTPUT.so --arch 80 --cuda-version 13.0 [-I DIR …] [--cxx g++]

1. The source is preprocessed with the shim headers (include/emu_kernel.h first) and CUEMU_SCAN defined, so the
   words `__global__`, `__shared__` and `__launch_bounds__` survive macro expansion.
2. Each kernel (`__global__ void name(`) is listed; each `__shared__` declaration becomes a reference into the
   running block's shared memory (the runtime's cuemu_static_shared / cuemu_dynamic_shared), so that every block
   has its own, bounds-checked, as on the GPU.
3. The result is compiled with GCC's thread-sanitizer instrumentation, which calls the runtime on every load,
   store and atomic operation, and without floating-point contraction (the kernels are built for the GPU with
   -fmad=false).
4. With --uninstrumented, steps 1–3 again with CUEMU_FAST defined (the shims' fast variants: include/mma.h) and
   without the instrumentation: the fast mode's build of the module.
"""
import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?([A-Za-z_]\w*)\s*\(")
LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)")
ATTRIBUTE = re.compile(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)")
ALIGNED = re.compile(r"aligned\s*\(\s*(\d+)\s*\)")


def die(message):
    sys.exit(f"kernelize.py: {message}")


def brace_depth(text, end):
    """The `{}` nesting depth at offset `end` (string and character literals are rare in kernels and hold no braces)."""
    return text.count("{", 0, end) - text.count("}", 0, end)


def split_top_level(text, sep=","):
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "([<":
            depth += 1
        elif c in ")]>":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def rewrite_shared(text, source):
    """Every `[extern] [static] __shared__ [attrs] TYPE decl[, decl…];` becomes references to block shared memory."""
    out, pos, site = [], 0, 0
    for m in re.finditer(r"\b__shared__\b", text):
        if m.start() < pos:
            continue
        # Qualifiers right before the keyword belong to the declaration.
        head = m.start()
        prefix = re.search(r"((?:\b(?:extern|static)\b\s*)+)$", text[pos:head])
        is_extern = False
        if prefix:
            is_extern = "extern" in prefix.group(1)
            head = pos + prefix.start()
        end = text.index(";", m.end())
        decl = text[m.end():end]
        if brace_depth(text, head) == 0:
            die(f"{source}: a __shared__ variable at file scope is not supported (declare it inside the kernel)")
        align = 0
        for a in ATTRIBUTE.findall(decl):
            n = ALIGNED.search(a)
            if n:
                align = max(align, int(n.group(1)))
        decl = ATTRIBUTE.sub(" ", decl).strip()
        declarators = split_top_level(decl)
        first = re.match(r"(.*?)([A-Za-z_]\w*)\s*((?:\[[^\]]*\])*)$", declarators[0], re.S)
        if not first:
            die(f"{source}: cannot read the __shared__ declaration `{decl}`")
        base_type = first.group(1).strip()
        pieces = []
        for d in [first.group(2) + first.group(3)] + declarators[1:]:
            dm = re.match(r"(\**)\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\])*)$", d)
            if not dm:
                die(f"{source}: cannot read the __shared__ declarator `{d}`")
            stars, name, dims = dm.groups()
            ty = base_type + stars
            alignment = f"alignof({ty})" if not align else f"({align} > alignof({ty}) ? {align} : alignof({ty}))"
            if is_extern:
                if not dims.startswith("[]"):
                    die(f"{source}: extern __shared__ `{d}` must be an array of unknown size")
                pieces.append(f"{ty} *const {name} = reinterpret_cast<{ty} *>(cuemu_dynamic_shared());")
            elif dims:
                site += 1
                pieces.append(
                    f"static char cuemu_site_{site}; {ty} (&{name}){dims} = *reinterpret_cast<{ty} (*){dims}>("
                    f"cuemu_static_shared(&cuemu_site_{site}, sizeof({ty}{dims}), {alignment}));")
            else:
                site += 1
                pieces.append(
                    f"static char cuemu_site_{site}; {ty} &{name} = *reinterpret_cast<{ty} *>("
                    f"cuemu_static_shared(&cuemu_site_{site}, sizeof({ty}), {alignment}));")
        out.append(text[pos:head])
        out.append(" ".join(pieces))
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("output")
    ap.add_argument("--arch", required=True, help="__CUDA_ARCH__ / 10, e.g. 80: the PTX target of the same module")
    ap.add_argument("--cuda-version", required=True, help="the toolkit's version, e.g. 13.0 (__CUDACC_VER_*__)")
    ap.add_argument("-I", dest="includes", action="append", default=[])
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--keep", help="also write the rewritten source here (for reading)")
    ap.add_argument("--uninstrumented", help="also build the module without the access instrumentation here (the "
                    "fast mode's: same arithmetic, no hook call per load and store)")
    args = ap.parse_args()

    major, minor = args.cuda_version.split(".")[:2]
    include = os.path.join(HERE, "include")
    defines = [f"-D__CUDA_ARCH__={int(args.arch) * 10}", f"-D__CUDACC_VER_MAJOR__={major}",
               f"-D__CUDACC_VER_MINOR__={minor}", "-D__CUDACC_VER_BUILD__=0", "-D__NVCC__"]
    incs = ["-I", include] + [f"-I{d}" for d in args.includes + [os.path.dirname(os.path.abspath(args.source))]]
    # No strict aliasing: CUDA code reads vectors through other types (a float4 load viewed as 8 bf16 values), which
    # nvcc compiles as written and GCC's type-based alias analysis would reorder.
    flags = ["-std=c++17", "-O2", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing", "-fno-fast-math", "-fno-exceptions",
             "-Wno-unknown-pragmas", "-w"]
    instrumented = ["-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0"]
    # (output, compiler options, defines): the fast build defines CUEMU_FAST, which changes the shims (mma.h).
    builds = [(args.output, flags + instrumented, [])]
    if args.uninstrumented:
        builds.append((args.uninstrumented, flags, ["-DCUEMU_FAST"]))
    for output, options, extra in builds:
        text = rewrite(args, defines + extra, incs)
        rewritten = output + ".ii"
        for path in [rewritten] + ([args.keep] if args.keep and not extra else []):
            with open(path, "w") as f:
                f.write(text)
        try:
            obj = output + ".o"
            # The instrumented build links without the sanitizer's runtime: the emulator defines its callbacks.
            build = subprocess.run([args.cxx, *options, "-c", "-x", "c++-cpp-output", rewritten, "-o", obj],
                                   capture_output=True, text=True)
            if build.returncode == 0:
                build = subprocess.run([args.cxx, "-shared", obj, "-o", output], capture_output=True, text=True)
            if os.path.exists(obj):
                os.unlink(obj)
            if build.returncode != 0:
                sys.stderr.write(build.stderr[-20000:])
                die(f"cannot compile {args.source} (rerun with --keep FILE to read the rewritten source)")
        finally:
            os.unlink(rewritten)


def rewrite(args, defines, incs):
    """The source preprocessed with `defines`, its kernels listed and its shared memory rewritten (steps 1 and 2)."""
    pre = subprocess.run(
        [args.cxx, "-E", "-std=c++17", "-DCUEMU_SCAN", *defines, *incs, "-include", "emu_kernel.h", "-x", "c++",
         args.source], capture_output=True, text=True)
    if pre.returncode != 0:
        sys.stderr.write(pre.stderr)
        die(f"cannot preprocess {args.source}")
    text = pre.stdout

    kernels = []
    for m in KERNEL.finditer(text):
        before = text[max(0, m.start() - 200):m.start()]
        if re.search(r"template\s*<[^;{}]*>\s*(?:extern\s+\"C\"\s*)?$", before):
            die(f"{args.source}: template kernel `{m.group(1)}`: only extern \"C\" kernels can be found by name")
        kernels.append(m.group(1))
    if not kernels:
        die(f"{args.source}: no __global__ kernels")
    text = LAUNCH_BOUNDS.sub("", text)
    text = re.sub(r"\b__global__\b", "", text)
    text = rewrite_shared(text, args.source)
    table = ",\n    ".join(f'cuemu_registry::entry<&{k}>("{k}")' for k in sorted(set(kernels)))
    return text + f"""
static const cuemu_kernel cuemu_kernel_table[] = {{
    {table}
}};
extern "C" __attribute__((visibility("default"))) const cuemu_kernel *cuemu_module_kernels(unsigned *count) {{
    *count = {len(set(kernels))};
    return cuemu_kernel_table;
}}
"""


if __name__ == "__main__":
    main()
