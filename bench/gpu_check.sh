#!/usr/bin/env bash
# The GPU checks of rpeg_jax in ONE command on one NVIDIA H200: bf16 and Pallas-kernel correctness
# tests, G1 generation throughput (gather and kernel attention) on S and a ~0.5B Qwen2 shape, the 1.5B
# actor update's MFU (xla and cuDNN attention), an h200 cost-model calibration, the cost model's error
# on real GPU stages, R1-a and R2 (bench/NOTES.md, "GPU check", says how to read the results).
#
#   bash bench/gpu_check.sh              # on the H200 machine, from anywhere (it cd's to the repo root)
#   bash bench/gpu_check.sh --dry-run    # on a CPU: the same parts with tiny sizes (plumbing, not numbers)
#
# Parts, most important first, each under `timeout` (caps in seconds below; a part starts only with
# >= 15 s left before the deadline, and is cut to the time left):
#   1 env       nvidia-smi, python, package versions, jax backend/devices
#   2 tests     pytest -m gpu over every tests/ file with `pytest.mark.gpu` (test_gpu.py: bf16 checks vs
#               independent references; test_kernel_attention.py: the Triton-compiled paged kernel)
#   3 generate  bench/generate.py G1-S-greedy + G1-Q05-greedy, bf16, --attention gather (with the naive
#               baseline) then --attention kernel: tok/s, fraction of HBM bandwidth
#   4 train     bench/train_mfu.py: one qwen2-1.5b actor update (16 x 1024, bf16 compute, float32
#               params/Adam), --attention xla then cudnn: seconds, MFU, the cost model's prediction
#   5 calibrate python -m rpeg_jax.cli calibrate --profile h200 --quick --no-real-stages (micro-benchmarks
#               + synthetic fit; part 7 measures and fits the real stages within its own budget)
#   6 r2        bench/rl_step.py R2 (sync, async-k1, async-k2; grain needed), predicted with part 5's profile
#   7 stages    bench/costmodel_validate.py --gpu: real 0.5B/1.5B bf16 stages on 1 GPU, fit on the
#               calibration half, MAPE on the validation half
#   8 r1        bench/rl_step.py R1-a (grain needed; a tiny-model step on the GPU)
# On a fresh machine the tests part pays the cold compiles (Triton, XLA autotuning): 7 of its 13 tests
# took 101 s there on 2026-12-04, all 13 took 32 s on the same machine warm.
# Files under $OUT (default /tmp/rpeg_gpu_check, /tmp/rpeg_gpu_check_dry for --dry-run), at most 8 (the
# device tool returns 8): gpu_check.log, summary.json (also holds the calibrated profile of part 5 in
# full), generate.json (gather + kernel records), train.json (xla + cudnn records), gpu_stages.json,
# h200_stages.yaml and h200_stages.points.json (the stage-fitted profile and its points, reusable with
# `rpeg calibrate --points`), rl_step.json (R1-a + R2 records). The parts write generate_gather.json,
# generate_kernel.json, train_xla.json, train_cudnn.json, h200.yaml and rl_step_r2.json first; the
# summary merges them into those files and removes them. The last lines printed are the summary. The
# exit status is 0 when every part that ran returned 0. Calibrated profiles go to a temporary
# RPEG_CACHE, never ~/.cache/rpeg_jax.
#
# Python: .venv/bin/python when it exists, else python3, with rpeg_jax's dependencies and test extras
# (`pip install -e '.[test]'`), JAX for CUDA (`pip install -U "jax[cuda12]"`, or the CUDA 13 build
# matching the driver) and scipy (the calibration fits). grain (with array_record and portpicker) is
# needed only by parts 7-8 (rpeg_jax.data). If Python lacks it and the machine has no network access,
# download the wheels elsewhere into .whl/ in the repo root and copy that folder over; this script
# installs them into /tmp/site when `import grain` fails:
#   mkdir -p .git/info; grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#     grain==0.2.18 array_record==0.8.6 portpicker==1.6.0
# Without grain parts 1-6 still run and 7-8 are skipped. Env: OUT (the output folder),
# GPU_CHECK_NAIVE=0 skips the naive generation baseline; GPU_CHECK_DEADLINE (s, default 540; dry run
# 400) bounds the whole run; GPU_CHECK_DRY_R2=1 runs part 8 in the dry run too (R2 --steps 2 took 57-63 s
# on the 2-core development CPU, so the dry run skips it by default).

set -u -o pipefail
DRY=${GPU_CHECK_DRY:-0}
[ "${1:-}" = "--dry-run" ] && DRY=1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
if [ -z "${OUT:-}" ]; then OUT=/tmp/rpeg_gpu_check$([ "$DRY" = 1 ] && echo _dry); fi
mkdir -p "$OUT"
export OUT
if [ -z "${GPU_CHECK_CHILD:-}" ]; then  # a plain pipe (not exec > >(tee)): tee has written all before we return
  GPU_CHECK_CHILD=1 bash "$ROOT/bench/gpu_check.sh" "$@" 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
START=$(date +%s)
# no stale part files from an earlier run into this run's merge (the log is being written by tee)
rm -f "$OUT"/{generate,generate_gather,generate_kernel,train,train_xla,train_cudnn,gpu_stages,rl_step,rl_step_r2,summary}.json \
  "$OUT"/{cpu,h200}.yaml "$OUT"/{cpu,h200}_stages.yaml "$OUT"/{cpu,h200}_stages.points.json
DEADLINE=${GPU_CHECK_DEADLINE:-$([ "$DRY" = 1 ] && echo 400 || echo 540)}
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
TMPD=$(mktemp -d /tmp/gpu_check.XXXXXX)
export RPEG_CACHE="$TMPD/cache"  # calibrated profiles / points: never the user's ~/.cache/rpeg_jax
STEPS="$TMPD/steps.tsv"
: > "$STEPS"

left() { echo $((DEADLINE - ($(date +%s) - START))); }
# step NAME CAP CMD...: run CMD under timeout min(CAP, time left); record rc and seconds.
step() {
  local name=$1 cap=$2; shift 2
  local l; l=$(left)
  [ "$l" -lt "$cap" ] && cap=$l
  if [ "$cap" -lt 15 ]; then
    echo "=== [$name] SKIPPED: ${l}s left"; printf '%s\tskipped\t0\t%s\n' "$name" "$cap" >> "$STEPS"; return 0
  fi
  echo "=== [$name] (cap ${cap}s, $(($(date +%s) - START))s elapsed) $*"
  local t0 rc; t0=$(date +%s)
  timeout -k 10 "$cap" "$@"; rc=$?
  echo "=== [$name] rc=$rc in $(($(date +%s) - t0))s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$cap" >> "$STEPS"
}

# ---- wheels (grain for R1) -------------------------------------------------------------------
if ! $PY -c "import grain" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" && echo "installed carried wheels: $(ls .whl)"
fi

# ---- 1 env -----------------------------------------------------------------------------------
env_report() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
  $PY - <<'EOF'
import importlib.metadata as md, json, os, platform, sys
import jax
vers = {}
for n in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "chex",
          "numpy", "scipy", "grain", "pytest", "hypothesis"):
    try:
        vers[n] = md.version(n)
    except md.PackageNotFoundError:
        vers[n] = None
env = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
       "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
       "device_kind": jax.devices()[0].device_kind, "versions": vers}
print(json.dumps(env, indent=1))
with open(os.environ["GPU_CHECK_ENV_JSON"], "w") as f:
    json.dump(env, f)
EOF
}
export GPU_CHECK_ENV_JSON="$TMPD/env.json" PY
export -f env_report
step env 40 bash -c env_report

# ---- 2 tests ---------------------------------------------------------------------------------
export RPEG_GPU_TEST_REPORT="$TMPD/test_report.jsonl"
mapfile -t GPU_TESTS < <(grep -l 'pytest.mark.gpu' tests/test_*.py)
if [ "$DRY" = 1 ]; then  # unskip on the CPU (conftest would add the skip): plumbing only, a subset; the
  # kernel file's own CPU tests (the Pallas interpreter), since its gpu-marked ones need Triton
  step tests 100 env RPEG_GPU_TESTS_ON_CPU=1 $PY -m pytest -q -p no:cacheprovider --noconftest "${GPU_TESTS[@]}" \
    -k "(test_gpu and (16-2 or trainer or grpo)) or (sampler_kernel_equals_gather and qwen2) or kernel_equals_float64" -rA
else
  step tests 140 $PY -m pytest -v -p no:cacheprovider -m gpu "${GPU_TESTS[@]}" -rA --tb=short
fi

# ---- 3 generate (G1 on the GPU: S in bf16 and a ~0.5B Qwen2 shape; gather, then the Pallas kernel) -
NAIVE=$([ "${GPU_CHECK_NAIVE:-1}" = 0 ] && echo --no-naive)
if [ "$DRY" = 1 ]; then
  step generate-gather 60 $PY bench/generate.py --workloads G1-T-greedy --reps 1 --no-naive --attention gather \
    --json "$OUT/generate_gather.json"
  step generate-kernel 80 $PY bench/generate.py --workloads G1-T-greedy --reps 1 --no-naive --attention kernel \
    --kernel-interpret --json "$OUT/generate_kernel.json"
else
  step generate-gather 70 $PY bench/generate.py --workloads G1-S-greedy,G1-Q05-greedy --reps 2 $NAIVE \
    --attention gather --json "$OUT/generate_gather.json"
  step generate-kernel 60 $PY bench/generate.py --workloads G1-S-greedy,G1-Q05-greedy --reps 2 --no-naive \
    --attention kernel --json "$OUT/generate_kernel.json"
fi

# ---- 4 train (one actor update's MFU: qwen2-1.5b, 16 x 1024, bf16 compute, float32 params) ------
if [ "$DRY" = 1 ]; then
  step train-xla 60 $PY bench/train_mfu.py --dry-run --attention xla --json "$OUT/train_xla.json"
  echo "=== [train-cudnn] SKIPPED: dry run (model.attention=cudnn needs a GPU)"
  printf 'train-cudnn\tskipped\t0\t0\n' >> "$STEPS"
else
  step train-xla 45 $PY bench/train_mfu.py --attention xla --json "$OUT/train_xla.json"
  step train-cudnn 45 $PY bench/train_mfu.py --attention cudnn --json "$OUT/train_cudnn.json"
fi

# ---- 5 calibrate (micro-benchmarks + synthetic stage fit) -------------------------------------
PROFILE=$([ "$DRY" = 1 ] && echo cpu || echo h200)
if [ "$DRY" = 1 ]; then  # the h200 sizes (4096^2 bf16 matmuls, 64 MB passes) take minutes on 2 cores
  step calibrate 40 $PY -m rpeg_jax.cli calibrate --profile cpu --quick --no-stages --devices 2 --out "$OUT/$PROFILE.yaml"
else
  step calibrate 60 $PY -m rpeg_jax.cli calibrate --profile h200 --quick --no-real-stages --out "$OUT/$PROFILE.yaml"
fi

# ---- 6 R2 (rpeg_jax.data needs grain) ------------------------------------------------------------
# R2's predictions: part 5's calibrated profile, else the uncalibrated preset (never a new calibration)
R2_HW="$OUT/$PROFILE.yaml"; [ -f "$R2_HW" ] || R2_HW="configs/hardware/$PROFILE.yaml"
HAVE_GRAIN=0; $PY -c "import grain" 2>/dev/null && HAVE_GRAIN=1
if [ "$HAVE_GRAIN" = 0 ]; then
  echo "=== [r2] SKIPPED: grain is not importable (carry .whl, see the header)"; printf 'r2\tno-grain\t0\t0\n' >> "$STEPS"
elif [ "$DRY" = 1 ] && [ "${GPU_CHECK_DRY_R2:-0}" != 1 ]; then
  echo "=== [r2] SKIPPED: dry run (R2 --steps 2 takes ~60 s on 2 CPU cores: 63 and 57 s; GPU_CHECK_DRY_R2=1 runs it)"
  printf 'r2\tskipped\t0\t0\n' >> "$STEPS"
else
  step r2 $([ "$DRY" = 1 ] && echo 120 || echo 100) $PY bench/rl_step.py --workloads R2 --steps 2 --warmup 1 \
    --hardware "$R2_HW" --run-dir "$TMPD/r2" --json "$OUT/rl_step_r2.json"
fi

# ---- 7 stages (real model stages on 1 GPU; fit on the calibration half, MAPE on the other) ----
START_PROF=()
[ -f "$OUT/$PROFILE.yaml" ] && START_PROF=(--start "$OUT/$PROFILE.yaml")
if [ "$DRY" = 1 ]; then
  step stages 70 $PY bench/costmodel_validate.py --gpu --dry-run --hardware cpu "${START_PROF[@]}" --repeats 2 \
    --budget-s 40 --json "$OUT/gpu_stages.json" --out "$OUT/${PROFILE}_stages.yaml"
else  # no new configuration after BUDGET s: the last one's compile + runs and the fit fit in the cap
  BUDGET=$(( $(left) - 50 )); [ "$BUDGET" -gt 70 ] && BUDGET=70; [ "$BUDGET" -lt 20 ] && BUDGET=20
  step stages 110 $PY bench/costmodel_validate.py --gpu --hardware h200 "${START_PROF[@]}" --repeats 5 \
    --budget-s "$BUDGET" --json "$OUT/gpu_stages.json" --out "$OUT/${PROFILE}_stages.yaml"
fi

# ---- 8 R1 (if time is left; on the GPU a tiny-model step, ~0.05 s: plumbing more than numbers) ------
if [ "$HAVE_GRAIN" = 0 ]; then
  echo "=== [r1] SKIPPED: grain is not importable (carry .whl, see the header)"; printf 'r1\tno-grain\t0\t0\n' >> "$STEPS"
else
  step r1 $([ "$DRY" = 1 ] && echo 150 || echo 70) $PY bench/rl_step.py --workloads R1-a --steps 2 --warmup 1 \
    --run-dir "$TMPD/r1" --json "$OUT/rl_step.json"
fi

# ---- summary (merges the parts' files into at most 8 under $OUT) ---------------------------------
$PY - "$OUT" "$TMPD" "$DRY" "$(($(date +%s) - START))" <<'EOF'
import json, os, sys
out, tmp, dry, wall = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
def load(path, default=None):
    try:
        with open(os.path.join(out, path)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default
def records(*names):
    got = []
    for n in names:
        r = load(n, [])
        got += r if isinstance(r, list) else []
    return got
steps = [dict(zip(("name", "rc", "seconds", "cap"), l.rstrip("\n").split("\t"))) for l in open(os.path.join(tmp, "steps.tsv"))]
tests = [json.loads(l) for l in open(os.path.join(tmp, "test_report.jsonl"))] if os.path.exists(os.path.join(tmp, "test_report.jsonl")) else []
gen = records("generate_gather.json", "generate_kernel.json")
train = records("train_xla.json", "train_cudnn.json")
st = load("gpu_stages.json", {})
rl = [r for r in records("rl_step.json", "rl_step_r2.json")]
r1 = [r for r in rl if r.get("workload") != "R2"]
r2 = [r for r in rl if r.get("workload") == "R2"]
prof = "cpu" if dry else "h200"
cal = None
try:
    import yaml
    with open(os.path.join(out, f"{prof}.yaml")) as f:
        cal = yaml.safe_load(f)
except (OSError, ImportError):
    pass
def pick(r, keys):
    return {k: r.get(k) for k in keys}
summary = {"dry_run": dry, "wall_s": wall, "env": load(os.path.join(tmp, "env.json")), "steps": steps,
           "test_measurements": tests,
           "generate": [pick(r, ("workload", "variant", "attention", "attention_resolved", "kernel_interpret",
                                 "new_tokens_per_s", "median_tokens_per_s", "limit_fraction", "limit_kind",
                                 "bandwidth_bytes_s", "matmul_flops")) for r in gen],
           "train": [pick(r, ("preset", "batch", "seq", "dtype", "param_dtype", "attention", "attention_resolved",
                              "remat", "seconds", "best_seconds", "compile_s", "tokens_per_s", "tflops_per_s", "mfu",
                              "hfu", "peak_flops", "predicted_seconds", "predicted_bytes", "peak_bytes_in_use",
                              "finite")) for r in train],
           "calibrated": {"profile": prof, "device": (cal or {}).get("device"), "calibrated": (cal or {}).get("calibrated")},
           "calibrated_profile": cal,
           "stages": {k: st.get(k) for k in ("calibration_points", "validation_points", "skipped", "measure_seconds", "fit")}
                     | {f"mape_{n}": (st.get(n) or {}).get("mape_stage") for n in ("preset", "start", "fitted")}
                     | {f"mape_all_{n}": (st.get(n) or {}).get("mape_stage_all") for n in ("preset", "start", "fitted")}
                     | {f"memory_error_{n}": (st.get(n) or {}).get("memory_error") for n in ("preset", "start", "fitted")},
           "r1": r1,
           "r2": [pick(r, ("workload", "variant", "seconds_per_step", "predicted_seconds_per_step", "prediction_error",
                           "staleness_max", "occupancy", "limit_fraction")) for r in r2]}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
# the merged files (written before their parts are removed), then the parts
for name, recs, parts in (("generate.json", gen, ("generate_gather.json", "generate_kernel.json")),
                          ("train.json", train, ("train_xla.json", "train_cudnn.json")),
                          ("rl_step.json", rl, ("rl_step_r2.json",))):
    if recs:
        with open(os.path.join(out, name), "w") as f:
            json.dump(recs, f, indent=1)
    for p in parts:
        if os.path.exists(os.path.join(out, p)):
            os.remove(os.path.join(out, p))
if cal is not None:  # kept in full in summary.json ("calibrated_profile")
    os.remove(os.path.join(out, f"{prof}.yaml"))
print("\n==================== GPU CHECK SUMMARY" + (" (DRY RUN on CPU: plumbing only)" if dry else "") + " ====================")
e = summary["env"] or {}
print(f"device: {e.get('device_kind')} backend={e.get('backend')} python {e.get('python')} "
      f"jax {(e.get('versions') or {}).get('jax')} flax {(e.get('versions') or {}).get('flax')}; wall {wall}s")
print("steps: " + ", ".join(f"{s['name']}={s['rc']}({s['seconds']}s)" for s in steps))
for t in tests:
    print("  test " + t["test"] + ": " + ", ".join(f"{k}={v:.3g}" for k, v in t.items() if k not in ("test", "backend")))
for r in summary["generate"]:
    print(f"  G1 {r['workload']:14s} {r['variant']:6s} {r['attention_resolved'] or '?':6s}"
          f"{' (interpret)' if r['kernel_interpret'] else ''} {r['new_tokens_per_s'] or 0:10.1f} tok/s = "
          f"{100 * (r['limit_fraction'] or 0):.1f}% of {r['limit_kind']} (bw {(r['bandwidth_bytes_s'] or 0) / 1e9:.0f} GB/s)")
for r in summary["train"]:
    mem = f", peak {r['peak_bytes_in_use'] / 1e9:.1f} GB" if r.get("peak_bytes_in_use") else ""
    print(f"  train {r['preset']} {r['batch']}x{r['seq']} attention={r['attention_resolved']}: {r['seconds']:.3f} s, "
          f"MFU {100 * r['mfu']:.1f}% (HFU {100 * r['hfu']:.1f}%) of {r['peak_flops'] / 1e12:.3g} TFLOP/s, "
          f"{r['tokens_per_s']:.0f} tok/s; predicted {r['predicted_seconds']:.3f} s, "
          f"{r['predicted_bytes'] / 1e9:.1f} GB{mem}; compile {r['compile_s']:.1f} s")
d, c = summary["calibrated"]["device"] or {}, summary["calibrated"]["calibrated"] or {}
if c:
    print(f"  calibrate {prof}: matmul measured {c.get('matmul_peak_measured', 0) / 1e12:.1f} TFLOP/s, memory "
          f"{c.get('memory_bw_measured', 0) / 1e9:.0f} GB/s, synthetic fit MAPE {100 * c.get('stage_fit_mape', float('nan')):.1f}%")
s = summary["stages"]
print(f"  stages: {s.get('calibration_points')} calibration + {s.get('validation_points')} validation points, "
      f"skipped {len(s.get('skipped') or [])}")
for n in ("preset", "start", "fitted"):
    m = s.get(f"mape_{n}")
    if m:
        print(f"  stage MAPE ({n:6s}): " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in m.items())
              + f"; all {100 * s[f'mape_all_{n}']:.1f}%")
for r in r1:
    print("  R1 " + ", ".join(f"{k}={r[k]}" for k in ("workload", "variant", "seconds_per_step", "limit_fraction") if k in r))
for r in summary["r2"]:
    pred = r["predicted_seconds_per_step"]
    print(f"  R2 {r['variant']:9s} {r['seconds_per_step']:.3f} s/step, predicted "
          + (f"{pred:.3f} s ({100 * r['prediction_error']:+.0f}%)" if pred is not None else "-")
          + f", staleness_max {r['staleness_max']:.0f}, occupancy {r['occupancy']:.2f}")
files = sorted(os.listdir(out))
print(f"files in {out} ({len(files)}{'; OVER the device tool limit of 8' if len(files) > 8 else ''}): {files}")
EOF
SUMMARY_RC=$?
[ "$SUMMARY_RC" = 0 ] || echo "=== [summary] rc=$SUMMARY_RC (the part files stay unmerged in $OUT)"
FAIL=$(awk -F'\t' '$2 != "0" && $2 != "skipped" && $2 != "no-grain"' "$STEPS" | wc -l)
[ "$SUMMARY_RC" = 0 ] || FAIL=$((FAIL + 1))
rm -rf "$TMPD"
exit $([ "$FAIL" = 0 ] && echo 0 || echo 1)
