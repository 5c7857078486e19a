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

With model.lora the checkpoint's actor is the adapters: the plain export is the base (model.path, else
the random init of train.seed, as the run built it) with the adapters merged in (W + alpha/r B A), and
`adapter=True` (`rpeg export --adapter DIR`) writes them as a PEFT adapter directory instead
(adapter_config.json, adapter_model.safetensors: models/lora.write_peft_adapter), which
`PeftModel.from_pretrained(base, DIR)` loads (tests/fixtures/make_lora_fixtures.py --only train-export).

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


def export(
    run_dir: str, out: str, *, step: int | None = None, overwrite: bool = False, adapter: bool = False
) -> tuple[int, list[str]]:
    """Write the actor of `run_dir`'s checkpoint `step` (default: the latest) to `out` (adapter: the
    LoRA adapters as a PEFT adapter directory); returns the step and the files written."""
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
    if adapter and not cfg.model.lora.rank:
        raise ExportError(f"--adapter: the run trained no adapters ({config_file} has model.lora.rank=0)")
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
                if adapter:
                    return step, _write_adapter(ckpt, step, cfg, out, overwrite)
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
    checkpoint holds the shapes and dtypes config.yaml implies (model.lora: the base with the
    checkpoint's adapters merged in)."""
    import jax
    from flax import nnx

    from rpeg_jax.config.model import LoraConfig
    from rpeg_jax.models import adapters
    from rpeg_jax.models.llama import Transformer

    mcfg = _policy_config(cfg)
    if mcfg.lora.rank:  # the checkpoint holds the adapters; the base comes as the run built it
        base, restored = _base(cfg), _restore_adapters(ckpt, step, cfg)
        plain = dataclasses.replace(mcfg, lora=LoraConfig())
        graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(plain, rngs=nnx.Rngs(0))), nnx.Param)[0]
        return nnx.merge(graphdef, jax.jit(adapters.merged_weights, static_argnums=0)(mcfg, base, restored))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))), nnx.Param)
    _check_saved(ckpt, step, params)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_cpu()), params)
    return nnx.merge(graphdef, ckpt.restore_state(step, "actor", target))


def _check_saved(ckpt, step: int, params) -> None:
    from rpeg_jax.sharding.params import param_infos

    saved = ckpt.state_shapes(step, "actor")
    for info in param_infos(params):
        want = (info.shape, str(info.dtype))
        if saved.get(info.name) != want:
            raise ExportError(
                f"checkpoint {step} holds actor.{info.name} as {saved.get(info.name, 'nothing')}, "
                f"but config.yaml's model gives {want}"
            )


def _cpu():
    import jax

    return jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])


def _restore_adapters(ckpt, step: int, cfg):
    """model.lora: the checkpoint's adapters (the actor state) on the host's CPU device."""
    import jax
    from flax import nnx

    from rpeg_jax.models import adapters
    from rpeg_jax.models.llama import Transformer

    mcfg = _policy_config(cfg)
    abstract = adapters.split(nnx.state(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))), nnx.Param))[1]
    _check_saved(ckpt, step, abstract)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_cpu()), abstract)
    return ckpt.restore_state(step, "actor", target)


def _base(cfg):
    """model.lora: the frozen base on the host's CPU device, as runtime/setup.py built it (model.path,
    else the random init of train.seed)."""
    import jax
    from flax import nnx

    from rpeg_jax.config.model import LoraConfig
    from rpeg_jax.models import load_hf
    from rpeg_jax.models.llama import Transformer

    plain = dataclasses.replace(_policy_config(cfg), lora=LoraConfig())
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        if plain.path:
            return nnx.state(load_hf(plain.path, dtype=plain.param_dtype), nnx.Param)
        return jax.jit(lambda: nnx.state(Transformer(plain, rngs=nnx.Rngs(params=cfg.train.seed)), nnx.Param))()


def _write_adapter(ckpt, step: int, cfg, out: str, overwrite: bool) -> list[str]:
    """`rpeg export --adapter`: the checkpoint's adapters as a PEFT adapter directory."""
    import shutil

    from rpeg_jax.models.lora import to_peft, write_peft_adapter

    restored = _restore_adapters(ckpt, step, cfg)
    lora = cfg.model.lora
    if overwrite and os.path.isdir(out):
        shutil.rmtree(out)
    write_peft_adapter(
        out,
        cfg.model,
        to_peft(cfg.model, restored),
        rank=lora.rank,
        alpha=lora.scale * lora.rank,
        base_model=cfg.model.path,
    )
    return sorted(os.listdir(out))


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
