#!/usr/bin/env python3
# Regenerate the hybrid Qwen3.5 GGUF fixtures (run from the repository root):
#   /work/pyenv/bin/python tools/make_qwen35_gguf_fixtures.py LLAMA_CPP_DIR
# or convert another tokenizer-less qwen3_5 checkpoint (a `forge synth --checkpoint` directory):
#   /work/pyenv/bin/python tools/make_qwen35_gguf_fixtures.py LLAMA_CPP_DIR SRC_DIR OUTTYPE OUT.gguf
# LLAMA_CPP_DIR is `vendor/llama.cpp` of the `llama-cpp-python` 0.3.36 source package
# (`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`); its converter needs torch.
#
# Converts the transformers fixtures tests/fixtures/qwen35_tiny (f32) and qwen35_tiny_mm (bf16,
# tied embedding) with llama.cpp's own `convert_hf_to_gguf.py`, so the files carry every
# transformation that converter applies to `qwen35` (norms stored as 1 + w, A_log as -exp(A_log),
# value heads tiled when there are fewer key heads, conv1d squeezed) and Forge is checked against
# the real format, not a re-implementation of it. Writes tests/fixtures/qwen35_gguf/:
#   tiny-f32.gguf   qwen35_tiny, --outtype f32
#   tiny-q8_0.gguf  qwen35_tiny, --outtype q8_0 (matrices in Q8_0 blocks, vectors F32)
#   mm-bf16.gguf    qwen35_tiny_mm, --outtype bf16
# The fixtures have no tokenizer, so the converter's vocabulary step is skipped (the files hold
# no tokenizer.* keys); the multi-token-prediction export is off (--no-nextn), as the
# checkpoints have no MTP block.
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures")
OUT = os.path.join(FIX, "qwen35_gguf")

RUNS = [
    ("qwen35_tiny", "f32", "tiny-f32.gguf"),
    ("qwen35_tiny", "q8_0", "tiny-q8_0.gguf"),
    ("qwen35_tiny_mm", "bf16", "mm-bf16.gguf"),
]


def main():
    if len(sys.argv) not in (2, 5):
        sys.exit("usage: make_qwen35_gguf_fixtures.py LLAMA_CPP_DIR [SRC_DIR OUTTYPE OUT.gguf]")
    llama = os.path.abspath(sys.argv[1])
    runs = [(os.path.abspath(sys.argv[2]), sys.argv[3], os.path.abspath(sys.argv[4]))] if len(sys.argv) == 5 else [
        (os.path.join(FIX, src), outtype, os.path.join(OUT, name)) for src, outtype, name in RUNS
    ]
    sys.path.insert(0, llama)
    sys.path.insert(0, os.path.join(llama, "gguf-py"))
    import convert_hf_to_gguf as convert
    from conversion import qwen

    qwen.Qwen3_5TextModel.set_vocab = lambda self: None
    for src, outtype, dst in runs:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        sys.argv = ["convert_hf_to_gguf.py", src, "--outtype", outtype, "--no-nextn", "--outfile", dst]
        convert.main()
        print(f"wrote {dst} ({os.path.getsize(dst)} bytes)")


if __name__ == "__main__":
    main()
