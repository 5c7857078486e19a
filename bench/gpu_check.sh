#!/usr/bin/env bash
# The GPU checks of rpeg_jax in ONE command on one NVIDIA H200: bf16 correctness tests, G1 generation
# throughput on S and a ~0.5B Qwen2 shape, an h200 cost-model calibration, the cost model's error on
# real GPU stages, and R1-a (bench/NOTES.md, "GPU check", says how to read the results).
#
#   bash bench/gpu_check.sh              # on the H200 machine, from anywhere (it cd's to the repo root)
#   bash bench/gpu_check.sh --dry-run    # on a CPU: the same parts with tiny sizes (plumbing, not numbers)
#
# Parts, most important first, each under `timeout` (caps in seconds below; the whole run <= ~8 min):
#   1 env       nvidia-smi, python, package versions, jax backend/devices
#   2 tests     pytest -m gpu tests/test_gpu.py (bf16 checks vs independent references)
#   3 generate  bench/generate.py G1-S-greedy + G1-Q05-greedy, bf16: tok/s, fraction of HBM bandwidth
#   4 calibrate python -m rpeg_jax.cli calibrate --profile h200 --quick (micro-benchmarks + synthetic fit)
#   5 stages    bench/costmodel_validate.py --gpu: real 0.5B/1.5B bf16 stages on 1 GPU, fit on the
#               calibration half, MAPE on the validation half
#   6 r1        bench/rl_step.py R1-a (only if time is left and grain imports)
# Files under $OUT (default /tmp/rpeg_gpu_check, /tmp/rpeg_gpu_check_dry for --dry-run): gpu_check.log,
# summary.json, generate.json, h200.yaml (calibrated profile), gpu_stages.json, h200_stages.yaml and
# h200_stages.points.json (the stage-fitted profile and its points, reusable with `rpeg calibrate
# --points`), rl_step.json. The last lines printed are the summary. The exit status is 0 when every
# part that ran returned 0. Calibrated profiles go to a temporary RPEG_CACHE, never ~/.cache/rpeg_jax.
#
# Python: .venv/bin/python when it exists, else python3, with rpeg_jax's dependencies and test extras
# (`pip install -e '.[test]'`), JAX for CUDA (`pip install -U "jax[cuda12]"`, or the CUDA 13 build
# matching the driver) and scipy (the calibration fits). grain (with array_record and portpicker) is
# needed only by part 6 (rpeg_jax.data). If Python lacks it and the machine has no network access,
# download the wheels elsewhere into .whl/ in the repo root and copy that folder over; this script
# installs them into /tmp/site when `import grain` fails:
#   mkdir -p .git/info; grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#     grain==0.2.18 array_record==0.8.6 portpicker==1.6.0
# Without grain parts 1-5 still run and part 6 is skipped. Env: OUT (the output folder),
# GPU_CHECK_NAIVE=0 skips the naive generation baseline; GPU_CHECK_DEADLINE (s, default 470; dry run
# 170) bounds the whole run.

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
DEADLINE=${GPU_CHECK_DEADLINE:-$([ "$DRY" = 1 ] && echo 170 || echo 470)}
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
step env 60 bash -c env_report

# ---- 2 tests ---------------------------------------------------------------------------------
export RPEG_GPU_TEST_REPORT="$TMPD/test_report.jsonl"
if [ "$DRY" = 1 ]; then  # unskip on the CPU (conftest would add the skip): plumbing only, a subset
  step tests 100 env RPEG_GPU_TESTS_ON_CPU=1 $PY -m pytest -q -p no:cacheprovider --noconftest -m gpu \
    tests/test_gpu.py -k "16-2 or trainer or grpo" -rA
else
  step tests 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -rA
fi

# ---- 3 generate (G1 on the GPU: S in bf16 and a ~0.5B Qwen2 shape) ----------------------------
NAIVE=$([ "${GPU_CHECK_NAIVE:-1}" = 0 ] && echo --no-naive)
if [ "$DRY" = 1 ]; then
  step generate 60 $PY bench/generate.py --workloads G1-T-greedy --reps 1 --no-naive --json "$OUT/generate.json"
else
  step generate 120 $PY bench/generate.py --workloads G1-S-greedy,G1-Q05-greedy --reps 2 $NAIVE --json "$OUT/generate.json"
fi

# ---- 4 calibrate (micro-benchmarks + synthetic stage fit) -------------------------------------
PROFILE=$([ "$DRY" = 1 ] && echo cpu || echo h200)
if [ "$DRY" = 1 ]; then  # the h200 sizes (4096^2 bf16 matmuls, 64 MB passes) take minutes on 2 cores
  step calibrate 40 $PY -m rpeg_jax.cli calibrate --profile cpu --quick --no-stages --devices 2 --out "$OUT/$PROFILE.yaml"
else
  step calibrate 60 $PY -m rpeg_jax.cli calibrate --profile h200 --quick --out "$OUT/$PROFILE.yaml"
fi

# ---- 5 stages (real model stages on 1 GPU; fit on the calibration half, MAPE on the other) ----
START_PROF=()
[ -f "$OUT/$PROFILE.yaml" ] && START_PROF=(--start "$OUT/$PROFILE.yaml")
if [ "$DRY" = 1 ]; then
  step stages 70 $PY bench/costmodel_validate.py --gpu --dry-run --hardware cpu "${START_PROF[@]}" --repeats 2 \
    --budget-s 40 --json "$OUT/gpu_stages.json" --out "$OUT/${PROFILE}_stages.yaml"
else  # no new configuration after BUDGET s: the last one's compile + runs and the fit fit in the cap
  BUDGET=$(( $(left) - 60 )); [ "$BUDGET" -gt 120 ] && BUDGET=120; [ "$BUDGET" -lt 20 ] && BUDGET=20
  step stages 180 $PY bench/costmodel_validate.py --gpu --hardware h200 "${START_PROF[@]}" --repeats 5 \
    --budget-s "$BUDGET" --json "$OUT/gpu_stages.json" --out "$OUT/${PROFILE}_stages.yaml"
fi

# ---- 6 R1 (if time is left) ------------------------------------------------------------------
if $PY -c "import grain" 2>/dev/null; then
  step r1 150 $PY bench/rl_step.py --workloads R1-a --steps 2 --warmup 1 --run-dir "$TMPD/r1" --json "$OUT/rl_step.json"
else
  echo "=== [r1] SKIPPED: grain is not importable (carry .whl, see the header)"
  printf 'r1\tno-grain\t0\t0\n' >> "$STEPS"
fi

# ---- summary ---------------------------------------------------------------------------------
$PY - "$OUT" "$TMPD" "$DRY" "$(($(date +%s) - START))" <<'EOF'
import json, os, sys
out, tmp, dry, wall = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
def load(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default
steps = [dict(zip(("name", "rc", "seconds", "cap"), l.rstrip("\n").split("\t"))) for l in open(os.path.join(tmp, "steps.tsv"))]
tests = [json.loads(l) for l in open(os.path.join(tmp, "test_report.jsonl"))] if os.path.exists(os.path.join(tmp, "test_report.jsonl")) else []
gen = load(os.path.join(out, "generate.json"), [])
st = load(os.path.join(out, "gpu_stages.json"), {})
r1 = load(os.path.join(out, "rl_step.json"), [])
prof = "cpu" if dry else "h200"
cal = None
try:
    import yaml
    with open(os.path.join(out, f"{prof}.yaml")) as f:
        cal = yaml.safe_load(f)
except (OSError, ImportError):
    pass
summary = {"dry_run": dry, "wall_s": wall, "env": load(os.path.join(tmp, "env.json")), "steps": steps,
           "test_measurements": tests,
           "generate": [{k: r.get(k) for k in ("workload", "variant", "new_tokens_per_s", "median_tokens_per_s",
                                                "limit_fraction", "limit_kind", "bandwidth_bytes_s", "matmul_flops")}
                        for r in gen],
           "calibrated": {"profile": prof, "device": (cal or {}).get("device"), "calibrated": (cal or {}).get("calibrated")},
           "stages": {k: st.get(k) for k in ("calibration_points", "validation_points", "skipped", "measure_seconds", "fit")}
                     | {f"mape_{n}": (st.get(n) or {}).get("mape_stage") for n in ("preset", "start", "fitted")}
                     | {f"mape_all_{n}": (st.get(n) or {}).get("mape_stage_all") for n in ("preset", "start", "fitted")}
                     | {f"memory_error_{n}": (st.get(n) or {}).get("memory_error") for n in ("preset", "start", "fitted")},
           "r1": r1}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
print("\n==================== GPU CHECK SUMMARY" + (" (DRY RUN on CPU: plumbing only)" if dry else "") + " ====================")
e = summary["env"] or {}
print(f"device: {e.get('device_kind')} backend={e.get('backend')} python {e.get('python')} "
      f"jax {(e.get('versions') or {}).get('jax')} flax {(e.get('versions') or {}).get('flax')}; wall {wall}s")
print("steps: " + ", ".join(f"{s['name']}={s['rc']}({s['seconds']}s)" for s in steps))
for t in tests:
    print("  test " + t["test"] + ": " + ", ".join(f"{k}={v:.3g}" for k, v in t.items() if k not in ("test", "backend")))
for r in summary["generate"]:
    print(f"  G1 {r['workload']:14s} {r['variant']:6s} {r['new_tokens_per_s'] or 0:10.1f} tok/s = "
          f"{100 * (r['limit_fraction'] or 0):.1f}% of {r['limit_kind']} (bw {(r['bandwidth_bytes_s'] or 0) / 1e9:.0f} GB/s)")
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
for r in r1 if isinstance(r1, list) else []:
    print("  R1 " + ", ".join(f"{k}={r[k]}" for k in ("workload", "variant", "seconds_per_step", "limit_fraction") if k in r))
print(f"files in {out}: {sorted(os.listdir(out))}")
EOF
FAIL=$(awk -F'\t' '$2 != "0" && $2 != "skipped" && $2 != "no-grain"' "$STEPS" | wc -l)
rm -rf "$TMPD"
exit $([ "$FAIL" = 0 ] && echo 0 || echo 1)
