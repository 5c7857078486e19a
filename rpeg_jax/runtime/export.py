"""A run's trained policy (a checkpoint's actor) as a Hugging Face checkpoint directory: `export`,
which the command `rpeg export` (rpeg_jax/cli/export.py) calls.

The model comes from the run's config.yaml (with model.path, the checkpoint's shape and the run's
numerics and ids: config/hf.py). Only the actor's parameters are read from the
orbax checkpoint (runtime/checkpoint.py `restore_state`: no optimizer state, no training graph,
onto the host's CPU device) and written by models/hf.py `save_hf`: config.json and
model.safetensors (shards and an index past 5 GB), plus, when the run had them,
generation_config.json from model.path, the tokenizer's files (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, chat_template.jinja) from data.tokenizer's
directory, else model.path, and as chat_template.jinja the template the run rendered prompts with
(data.chat_template, found as data/chat.py finds it). A shared actor-critic's value head is left out: the result is a
plain LlamaForCausalLM / Qwen2ForCausalLM. Relative paths in config.yaml are read from the
current directory, as the run read them.

Errors (no run, no checkpoint, a step not saved, an output directory that is not empty, a
checkpoint that does not fit config.yaml) are an ExportError with one line (the command: exit 2).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

from rpeg_jax.config.run import load_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class ExportError(Exception):
    pass


def export(run_dir: str, out: str, *, step: int | None = None, overwrite: bool = False) -> tuple[int, list[str]]:
    """Write the actor of `run_dir`'s checkpoint `step` (default: the latest) to `out`; returns the
    step and the files written."""
    config_file = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_file):
        raise ExportError(f"{config_file} not found (--run-dir is a run's train.run_dir)")
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out) and not overwrite):
        raise ExportError(f"--out {out} exists and is not empty (pass --overwrite to replace it)")
    from rpeg_jax.runtime.checkpoint import CheckpointCorrupt, Checkpointer

    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not Checkpointer.has_checkpoint(ckpt_dir):
        raise ExportError(f"no checkpoint in {ckpt_dir}")
    cfg = load_config(config_file)
    from rpeg_jax.models.hf import save_hf

    with tempfile.TemporaryDirectory() as scratch:
        extra = _extra_files(cfg, scratch)
        ckpt = Checkpointer(ckpt_dir, async_save=False)
        try:
            steps = ckpt.all_steps()
            step = max(steps) if step is None else step
            if step not in steps:
                raise ExportError(f"step {step} is not in {ckpt_dir} (saved: {', '.join(map(str, sorted(steps)))})")
            try:
                model = _restore_actor(ckpt, step, cfg)
            except CheckpointCorrupt as e:
                saved = ", ".join(map(str, steps))
                raise ExportError(f"{e}; export another step with --step (saved: {saved})") from None
        finally:
            ckpt.close()
        save_hf(model, out, overwrite=overwrite, extra_files=extra)
    return step, sorted(os.listdir(out))


def _policy_config(cfg):
    """The actor's ModelConfig as runtime/setup.py builds it, without a value head (with
    model.path, config.yaml's model is already the checkpoint's: config/hf.py)."""
    return dataclasses.replace(cfg.model, value_head=False)


def _restore_actor(ckpt, step: int, cfg):
    """The actor's params at `step` in a Transformer on the host's CPU device, after checking the
    checkpoint holds the shapes and dtypes config.yaml implies."""
    import jax
    from flax import nnx

    from rpeg_jax.models.llama import Transformer
    from rpeg_jax.sharding.params import param_infos

    mcfg = _policy_config(cfg)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))), nnx.Param)
    saved = ckpt.state_shapes(step, "actor")
    for info in param_infos(params):
        want = (info.shape, str(info.dtype))
        if saved.get(info.name) != want:
            raise ExportError(
                f"checkpoint {step} holds actor.{info.name} as {saved.get(info.name, 'nothing')}, "
                f"but config.yaml's model gives {want}"
            )
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), params)
    return nnx.merge(graphdef, ckpt.restore_state(step, "actor", target))


def _extra_files(cfg, scratch: str) -> dict[str, str]:
    """{name in the export: source file}: the tokenizer's files, the chat template the run rendered
    prompts with, and generation_config.json. `scratch` receives a template that is not a file of
    its own (tokenizer_config.json's "chat_template" of another directory)."""
    from rpeg_jax.data.chat import find_template, search_dirs

    model_dir, tokenizer = cfg.model.path, cfg.data.tokenizer
    for key, p in (("data.tokenizer", tokenizer), ("model.path", model_dir)):
        if p and not os.path.exists(p):
            raise ExportError(f"{key}={p} (config.yaml) not found; run from the directory the run started in")
    dirs = search_dirs(cfg.data, model_dir)  # data.tokenizer's directory, then model.path (data/chat.py)
    out = {}
    for name in TOKENIZER_FILES:
        found = [os.path.join(d, name) for d in dirs if os.path.isfile(os.path.join(d, name))]
        if found:
            out[name] = found[0]
    if tokenizer:  # the file the run tokenized with, whatever its name
        out["tokenizer.json"] = tokenizer
    template = find_template(cfg.data, model_dir)  # None with data.chat_template=none: files as they are
    if template is not None:
        source, text, _ = template
        if os.path.isfile(source):
            out["chat_template.jinja"] = source
        elif out.get("tokenizer_config.json") != source.rsplit(":", 1)[0]:
            out["chat_template.jinja"] = os.path.join(scratch, "chat_template.jinja")
            with open(out["chat_template.jinja"], "w") as f:
                f.write(text)
    if model_dir and os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        out["generation_config.json"] = os.path.join(model_dir, "generation_config.json")
    return out
