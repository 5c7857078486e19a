"""The peers of the RS and G1 workloads, run in their OWN virtualenv (torch, transformers, trl; never
rpeg_jax's .venv, and rpeg_jax never imports torch): Hugging Face `generate` and TRL's GRPOTrainer on
the same model shape and work as bench/rs.py gives rpeg_jax. It prints one JSON record per run.

    python -m venv /tmp/peers && /tmp/peers/bin/pip install torch==2.13.0 transformers trl accelerate datasets
    /tmp/peers/bin/python bench/peers.py hf-generate --model rs --prompts 8 --n 4 --prompt-len 32 --new 48
    /tmp/peers/bin/python bench/peers.py trl-step --model rs --prompts 8 --n 4 --prompt-len 32 --new 48 --steps 3

Models (random init, seed 0, float32, no download): `t` is bench/WORKLOADS.md's T (vocab 128, 4 layers,
hidden 256, 4 heads, 2 kv heads, intermediate 768, untied), `rs` SmolLM2-135M's shape (vocab 49152, 30
layers, hidden 576, 9 heads, 3 kv heads, intermediate 1536, tied). Generation ignores eos
(min_new_tokens = max_new_tokens): every sequence makes exactly --new tokens, as rpeg_jax's side does
with rollout.ignore_eos. Threads: torch uses the cores it sees (torch.get_num_threads()), as XLA does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

MODELS = {
    "t": dict(
        vocab_size=128,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=768,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
    ),
    "rs": dict(
        vocab_size=49152,
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
}


def build(name: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**MODELS[name], bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def prompts_of(name: str, prompts: int, length: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(3, MODELS[name]["vocab_size"], (prompts, length), generator=g)


def hf_generate(args) -> dict:
    import torch

    model = build(args.model)
    ids = prompts_of(args.model, args.prompts, args.prompt_len)
    kw = dict(
        max_new_tokens=args.new,
        min_new_tokens=args.new,
        num_return_sequences=args.n,
        do_sample=args.temperature > 0,
        pad_token_id=0,
    )
    if args.temperature > 0:
        kw.update(temperature=args.temperature, top_k=0, top_p=1.0)
    rates = []
    with torch.inference_mode():
        for rep in range(args.reps + 1):  # the first: warm-up
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            dt = time.perf_counter() - t0
            new = (out.shape[1] - ids.shape[1]) * out.shape[0]
            if rep:
                rates.append(new / dt)
    return {"peer": "hf-generate", "tokens_per_s": max(rates), "median_tokens_per_s": statistics.median(rates)}


def trl_step(args) -> dict:
    """Seconds per GRPO step of TRL's GRPOTrainer: `prompts` x `n` completions of exactly `new`
    tokens (HF generate, no vLLM), a constant-time reward, one optimizer step per batch (verl / TRL
    GRPO defaults: lr 1e-6, beta 0 (no reference), 1 iteration)."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = MODELS[args.model]["vocab_size"]
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.padding_side = "left"
    ids = prompts_of(args.model, args.prompts * (args.steps + 1), args.prompt_len)
    data = Dataset.from_dict({"prompt": [" ".join(f"w{int(t)}" for t in row) for row in ids]})

    def reward(completions, **kw):
        return [float(len(c) % 7) / 7 for c in completions]

    cfg = GRPOConfig(
        output_dir="/tmp/trl_peer",
        per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n,
        max_completion_length=args.new,
        learning_rate=1e-6,
        beta=0.0,
        num_iterations=1,
        temperature=1.0,
        generation_kwargs={"min_new_tokens": args.new},
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        max_steps=args.steps + 1,
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    times: list[float] = []

    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    torch.manual_seed(0)
    trainer = GRPOTrainer(
        model=build(args.model), reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok
    )
    trainer.add_callback(Clock())
    trainer.train()
    measured = times[1:]  # the first step: warm-up
    return {"peer": "trl-grpo", "seconds_per_step": statistics.median(measured), "steps_s": measured}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("hf-generate", "trl-step"))
    ap.add_argument("--model", choices=sorted(MODELS), default="rs")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    rec = hf_generate(args) if args.what == "hf-generate" else trl_step(args)
    rec.update(
        model=args.model,
        prompts=args.prompts,
        n=args.n,
        prompt_len=args.prompt_len,
        new=args.new,
        temperature=args.temperature,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
    )
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
