"""Step time and peak memory of DP training against non-private Keras Adam.

    python benchmarks/benchmark.py                 # all configurations
    python benchmarks/benchmark.py --configs=cnn --jit=false
    python benchmarks/benchmark.py --configs=cnn --dtype_policy=mixed_bfloat16

Each (configuration, variant) runs in a process of its own, so that its peak
memory is its own: the process builds the model and data, measures its
resident memory, warms up (tracing / compiling), then times `--steps` train
steps and reports the median step time (and the mean CPU time the process
used per step, which other processes on a shared machine inflate much less
than the wall time) and two peaks of memory above what it had before
training: the process' resident memory (RSS: what the machine
sees, including TensorFlow's allocator reserves, oneDNN's caches and the
traced graphs), and the most bytes of tensors alive at once during the timed
steps (TensorFlow's allocator statistics; on GPU this is the usual measure).
The parent prints the ratios of the DP variants to the non-private step
measured in the same run of this script.

Configurations:
  cnn:       the paper's CNN on 32x32x3 inputs, batch 256.
  text:      the examples' BERT classifier (last block + head trainable),
             sequence length 128, batch 32 (the MiniLM preset if installed,
             else a randomly initialized BERT of the same shape).
  cnn_accum: the CNN at logical batch 2048 = 8 x 256 with accumulation; its
             memory is compared with the non-private step at the physical 256.
  lora:      LoRA fine-tuning of MiniLM (the preset if installed, else a
             random BERT of its shape): rank 8 on every attention projection
             (query, key, value, attention_output EinsumDense layers), the
             rest frozen, a Dense head on the [CLS] token; sequence length
             128, batch 32.
  full:      full fine-tuning of MiniLM (the preset if installed, else a
             random BERT of its shape): every weight of the backbone
             trainable (token, position and segment embeddings, their layer
             norm, all 6 transformer blocks) except the pooler, which the
             head does not use; a Dense head on the [CLS] token; sequence
             length 128, batch 32.
  wsconv:    the paper's CNN with weight-standardized convolutions and group
             normalization (De et al. 2022), batch 256.
  clip:      the CNN (batch 256) with per-layer clipping, adaptive
             clipping (C toward the median norm) and both.

For the DP variants that take the ghost path, the child also reports how
each trainable variable's per-example blocks were computed
(`ghost_clipping.block_modes`: the ghost norm or materialized); the parent
prints them grouped by layer name.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

flags.DEFINE_list("configs", ["cnn", "text", "cnn_accum"], "Configurations.")
flags.DEFINE_list("jit", ["false", "true"], "XLA settings to measure.")
flags.DEFINE_integer("steps", 20, "Timed steps after warm-up.")
flags.DEFINE_integer("warmup", 3, "Untimed steps first.")
flags.DEFINE_list("variants", None,
                  "Only these variants (e.g. nonprivate,dpadam_corrected+secure);"
                  " default: all of each configuration.")
flags.DEFINE_string("output", None, "Also write the results as JSON here.")
flags.DEFINE_string("child", None, "Internal: run one variant, as JSON.")
flags.DEFINE_enum("dtype_policy", "float32",
                  ["float32", "mixed_float16", "mixed_bfloat16", "float16",
                   "bfloat16"],
                  "Keras' global dtype policy in every child (all variants,"
                  " the non-private one included).")
FLAGS = flags.FLAGS

# (configuration, variant) pairs; "nonprivate" is the reference of its
# configuration. cnn_accum is compared with cnn's nonprivate step.
# "dpadam_corrected" uses make_private's default (ghost clipping where the
# model allows it); "+vectorized" forces the vectorized per-example path;
# "+secure" is make_private(secure_mode=True) (each noise value a sum of
# several normals). "dpadam_stp" (DPAdamScaleThenPrivatize) scales each
# example's gradient before clipping: ghost clipping's scaled norms where the
# model allows ("+vectorized": the vectorized path); "dpadam_disk"
# (DPAdamDiSK) takes each example's gradient at shifted weights too: ghost
# clipping with a second pass where the model allows, "+vectorized" the
# vectorized path. "+per_layer" clips each layer to C / sqrt(L)
# (per_layer_clipping) and "+adaptive" moves C toward the median norm
# (target_unclipped_quantile=0.5); the "clip" configuration measures them on
# the CNN. "+bandsN" is correlated noise of N bands (noise_strategy=N); the
# "banded" configuration measures it on the CNN against one band.
def _bands(variant):
    """N of a "+bandsN" variant (correlated noise), else None."""
    for part in variant.split("+")[1:]:
        if part.startswith("bands"):
            return int(part[len("bands"):])
    return None


_VARIANTS = {
    "cnn": ["nonprivate", "dpadam_corrected", "dpadam_corrected+secure",
            "dpadam_corrected+vectorized", "dpadam_stp",
            "dpadam_stp+vectorized", "dpadam_disk", "dpadam_disk+vectorized"],
    "text": ["nonprivate", "dpadam_corrected", "dpadam_corrected+secure",
             "dpadam_stp", "dpadam_stp+vectorized", "dpadam_disk",
             "dpadam_disk+vectorized"],
    "cnn_accum": ["dpadam_corrected"],
    "banded": ["nonprivate", "dpadam_corrected", "dpadam_corrected+bands4",
               "dpadam_corrected+bands8"],
    "lora": ["nonprivate", "dpadam_corrected", "dpadam_disk",
             "dpadam_disk+vectorized"],
    "full": ["nonprivate", "dpadam_corrected"],
    "wsconv": ["nonprivate", "dpadam_corrected", "dpadam_stp",
               "dpadam_stp+vectorized"],
    "clip": ["nonprivate", "dpadam_corrected", "dpadam_corrected+per_layer",
             "dpadam_corrected+adaptive",
             "dpadam_corrected+per_layer+adaptive",
             "dpadam_corrected+per_layer+vectorized"],
}
# LoRA rank and target layers of the "lora" configuration.
_LORA_RANK = 8
_LORA_TARGETS = ["query", "key", "value", "attention_output"]


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_seconds():
    """CPU time of this process so far (all threads, user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _allocator_info():
    """TensorFlow's CPU allocator `{"current", "peak"}` bytes, or None.

    Available when TensorFlow's CPU allocator keeps statistics (the default
    oneDNN build's does; with TF_ENABLE_ONEDNN_OPTS=0 or
    TF_ONEDNN_USE_SYSTEM_ALLOCATOR=true it does not).
    """
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:
        return None
    # Allocators without statistics (e.g. TF_ONEDNN_USE_SYSTEM_ALLOCATOR)
    # report zeros.
    return info if info["peak"] > 0 else None


def _cnn_setup(batch, steps):
    import numpy as np

    from research import models

    x = np.random.default_rng(0).random((batch, 32, 32, 3), "float32")
    y = np.random.default_rng(1).integers(0, 10, batch)
    return (lambda: models.make_cnn((32, 32, 3), 10)), x, y


def _wsconv_setup(batch, steps):
    from research import models

    _, x, y = _cnn_setup(batch, steps)
    return (lambda: models.make_cnn((32, 32, 3), 10,
                                    normalization="group")), x, y


def _text_setup(batch, steps):
    from research import models

    try:
        preset = models.default_offline_preset()
    except (ImportError, FileNotFoundError):
        # A random BERT of MiniLM's shape (6 layers, 384 wide).
        preset = models.make_tiny_bert(
            num_layers=6, hidden_dim=384, num_heads=12,
            intermediate_dim=1536, sequence_length=128,
        )
    model, preprocessor = models.make_text_classifier(
        preset, num_classes=3, sequence_length=128
    )
    return (lambda: model), *_text_batch(preprocessor, batch)


def _text_batch(preprocessor, batch):
    """`(x, y)`: `batch` long sentences (128 tokens) and 3-class labels."""
    import numpy as np

    x = preprocessor(["a fairly long sentence for the benchmark " * 20] * batch)
    x = {k: np.asarray(v) for k, v in x.items()}
    return x, np.random.default_rng(1).integers(0, 3, batch)


def _minilm_shaped_bert(sequence_length):
    """`(backbone, preprocessor)`: the MiniLM preset if installed, else a
    randomly initialized BERT of its shape (6 layers, 384 wide)."""
    from research import models

    try:
        return models.load_bert(models.default_offline_preset(),
                                sequence_length=sequence_length)
    except (ImportError, FileNotFoundError):
        return models.make_tiny_bert(
            num_layers=6, hidden_dim=384, num_heads=12,
            intermediate_dim=1536, sequence_length=sequence_length,
        )


def _cls_head_setup(batch, prepare):
    """MiniLM (seq 128) with a Dense head on the [CLS] token, `prepare`
    called on the backbone first (to choose what is trainable)."""
    import keras

    from research import models

    backbone, preprocessor = _minilm_shaped_bert(128)
    prepare(backbone)
    inputs = {name: keras.Input((128,), dtype="int32", name=name)
              for name in models.TEXT_INPUTS}
    cls = backbone(inputs)["sequence_output"][:, 0, :]
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(cls))
    return (lambda: model), *_text_batch(preprocessor, batch)


def _lora_setup(batch, steps):
    return _cls_head_setup(batch, lambda backbone: backbone.enable_lora(
        _LORA_RANK, target_layer_names=_LORA_TARGETS))


def _full_setup(batch, steps):
    def prepare(backbone):
        # Every weight trainable, except the pooler: the head reads the
        # [CLS] token of the sequence output, so the pooler gets no gradient.
        backbone.trainable = True
        backbone.get_layer("pooled_dense").trainable = False

    return _cls_head_setup(batch, prepare)


# The configurations of a BERT text model (batch 32 instead of 256) and their
# setups; the others are the CNN's.
_TEXT_SETUPS = {"text": _text_setup, "lora": _lora_setup, "full": _full_setup}


def _block_modes(model, x, y):
    """`{layer path: {weight name: mode}}` of ghost clipping's blocks."""
    import keras

    from tf_dpadam.privatizer import ghost_clipping

    if not hasattr(ghost_clipping, "block_modes"):  # an older tf_dpadam
        return None

    def loss_fn(y, y_pred, sample_weight):
        return keras.losses.sparse_categorical_crossentropy(
            y, y_pred, from_logits=True)

    modes = ghost_clipping.block_modes(model, loss_fn, x, y)
    out = {}
    for path, kinds in modes.items():
        layer, _, weight = path.rpartition("/")
        out.setdefault(layer, {})[weight] = "+".join(kinds)
    return out


def _child(spec):
    config, variant, jit = spec["config"], spec["variant"], spec["jit"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_dpadam

    tf.get_logger().setLevel("ERROR")
    keras.mixed_precision.set_global_policy(FLAGS.dtype_policy)
    physical = 32 if config in _TEXT_SETUPS else 256
    accumulation = 8 if config == "cnn_accum" else 1
    setup = _TEXT_SETUPS.get(
        config, _wsconv_setup if config == "wsconv" else _cnn_setup)
    build, x, y = setup(physical, FLAGS.steps)
    model = build()
    unwrapped = model
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if variant == "nonprivate":
        optimizer = keras.optimizers.Adam(1e-3)
    else:
        clipping = "vectorized" if "+vectorized" in variant else "auto"
        model = tf_dpadam.make_private(model, clipping=clipping,
                                       secure_mode="+secure" in variant)
        optimizer_class = {
            "dpadam_corrected": tf_dpadam.DPAdamCorrected,
            "dpadam_stp": tf_dpadam.DPAdamScaleThenPrivatize,
            "dpadam_disk": tf_dpadam.DPAdamDiSK,
        }[variant.split("+")[0]]
        optimizer = optimizer_class(
            l2_norm_clip=1.0, noise_multiplier=1.0,
            batch_size=physical * accumulation,
            gradient_accumulation_steps=accumulation if accumulation > 1 else None,
            per_layer_clipping="+per_layer" in variant,
            target_unclipped_quantile=0.5 if "+adaptive" in variant else None,
            noise_strategy=_bands(variant),
        )
    model.compile(optimizer=optimizer, loss=loss, jit_compile=jit)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()

    def cyclic():
        """Timing only: the repeated batch passes for cyclic Poisson batches
        that continue the noise's cycle (fit refuses other data with b > 1
        bands); no epsilon is read."""
        bands = _bands(variant)
        if bands:
            from tf_dpadam.accounting import plans  # pylint: disable=import-outside-toplevel
            from tf_dpadam.data import sampling  # pylint: disable=import-outside-toplevel
            sampling.register_poisson(dataset, plans.PoissonPlan(
                physical * 64, physical, accumulation, groups=bands,
                group_offset=model.noise_history.draws % bands))
    baseline = _rss_bytes()
    tensors_before = _allocator_info()
    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    warmup = FLAGS.warmup * accumulation
    cyclic()
    model.fit(dataset, steps_per_epoch=warmup, verbose=0)
    cyclic()
    times.clear()
    if tensors_before is not None:
        tf.config.experimental.reset_memory_stats("CPU:0")
    timed = FLAGS.steps * accumulation
    cpu_start = _cpu_seconds()
    model.fit(dataset, steps_per_epoch=timed, verbose=0, callbacks=[Timer()])
    cpu_per_step = (_cpu_seconds() - cpu_start) / timed
    tensor_peak = _allocator_info()
    peak_rss = _peak_rss_bytes()
    clipping = getattr(model, "clipping_used", None)
    # Traced after the timed steps (not timed, nothing runs).
    modes = (_block_modes(unwrapped, x, y) if clipping == "ghost"
             and accumulation == 1 else None)
    # The rule of each layer: ghost (which) or fallback (why).
    rules = (tf_dpadam.privatizer.ghost_clipping.describe(unwrapped) if modes
             else None)
    # Time per physical batch; a logical step of cnn_accum is 8 of them.
    return {
        "config": config,
        "variant": variant,
        "jit": jit,
        "dtype_policy": FLAGS.dtype_policy,
        "physical_batch": physical,
        "logical_batch": physical * accumulation,
        "clipping": clipping,
        "median_step_seconds": statistics.median(times),
        # On a machine shared with other processes the wall time grows with
        # their load; the CPU time this process spent (mean over the timed
        # steps, all its threads) much less so. The 1-minute load average
        # at the end of the timed steps says how shared the machine was.
        "cpu_seconds_per_step": cpu_per_step,
        "load_average": os.getloadavg()[0],
        "peak_extra_bytes": peak_rss - baseline,
        # The most bytes of tensors alive at once during the timed steps,
        # above those alive before training (weights, data).
        "tensor_peak_extra_bytes": (
            None if tensors_before is None
            else tensor_peak["peak"] - tensors_before["current"]
        ),
        "trainable_parameters": int(
            sum(np.prod(v.shape) for v in model.trainable_variables)
        ),
        "block_modes": modes,
        "layer_rules": rules,
    }


def _run_child(spec):
    command = [sys.executable, os.path.abspath(__file__),
               f"--child={json.dumps(spec)}", f"--steps={FLAGS.steps}",
               f"--warmup={FLAGS.warmup}",
               f"--dtype_policy={FLAGS.dtype_policy}"]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(command, capture_output=True, text=True, env=env,
                         check=False)
    lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"{spec} failed:\n{run.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _mib(value):
    return "n/a" if value is None else f"+{value / 2**20:.1f} MiB"


def _ratios(results):
    rows = []
    reference = {}
    for r in results:
        if r["variant"] == "nonprivate":
            reference[(r["config"], r["jit"])] = r
    for r in results:
        if r["variant"] == "nonprivate":
            continue
        base_config = "cnn" if r["config"] == "cnn_accum" else r["config"]
        ref = reference.get((base_config, r["jit"]))
        if ref is None:
            continue
        rows.append({
            "config": r["config"],
            "variant": r["variant"],
            "clipping": r["clipping"],
            "jit": r["jit"],
            "time_ratio": r["median_step_seconds"] / ref["median_step_seconds"],
            "cpu_time_ratio": r["cpu_seconds_per_step"]
            / ref["cpu_seconds_per_step"],
            "memory_ratio": max(r["peak_extra_bytes"], 1)
            / max(ref["peak_extra_bytes"], 1),
            "tensor_memory_ratio": (
                None if r.get("tensor_peak_extra_bytes") is None
                or ref.get("tensor_peak_extra_bytes") is None
                else max(r["tensor_peak_extra_bytes"], 1)
                / max(ref["tensor_peak_extra_bytes"], 1)
            ),
            "dp_step_s": r["median_step_seconds"],
            "nonprivate_step_s": ref["median_step_seconds"],
            "dp_peak_mib": r["peak_extra_bytes"] / 2**20,
            "nonprivate_peak_mib": ref["peak_extra_bytes"] / 2**20,
        })
    return rows


def _modes_summary(block_modes, rules=None):
    """One line per (layer name, weight modes), counting the layers, with
    the rule of that name (`rules`, from `ghost_clipping.describe`)."""
    counts = {}
    for layer, weights in block_modes.items():
        name = layer.rsplit("/", 1)[-1]
        key = (name, tuple(sorted(weights.items())))
        counts[key] = counts.get(key, 0) + 1
    rules = rules or {}
    return [
        f"{name} x{n}"
        + (f" [{rules[name]}]" if name in rules else "") + ": "
        + ", ".join(f"{w} {m}" for w, m in weights)
        for (name, weights), n in sorted(counts.items())
    ]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if FLAGS.child:
        print("RESULT " + json.dumps(_child(json.loads(FLAGS.child))))
        return
    results = []
    for config in FLAGS.configs:
        needed = [v for v in _VARIANTS[config]
                  if FLAGS.variants is None or v in FLAGS.variants]
        if config == "cnn_accum" and "cnn" not in FLAGS.configs:
            needed = ["nonprivate@cnn"] + needed
        for jit in (j.lower() == "true" for j in FLAGS.jit):
            for variant in needed:
                name, _, other = variant.partition("@")
                spec = {"config": other or config, "variant": name, "jit": jit}
                result = _run_child(spec)
                results.append(result)
                print(f"{result['config']:9s} jit={str(jit):5s}"
                      f" {result['variant']:37s}"
                      f" {result['median_step_seconds'] * 1000:9.1f} ms/step"
                      f" (CPU {result['cpu_seconds_per_step'] * 1000:.0f} ms,"
                      f" load {result['load_average']:.1f})"
                      f" peak +{result['peak_extra_bytes'] / 2**20:8.1f} MiB"
                      f" RSS, {_mib(result['tensor_peak_extra_bytes'])}"
                      " tensors", flush=True)
    rows = _ratios(results)
    print("\nDP-AdamCorrected / non-private Adam (same machine, same run,"
          f" dtype policy {FLAGS.dtype_policy}):")
    print(f"{'config':10s} {'variant':37s} {'clipping':11s} {'jit':5s}"
          f" {'time x':>7s} {'CPU x':>7s}"
          f" {'RSS x':>7s} {'tensors x':>10s}")
    for row in rows:
        note = " (per physical batch of 256; memory vs non-private b=256)" \
            if row["config"] == "cnn_accum" else ""
        tensors = row["tensor_memory_ratio"]
        print(f"{row['config']:10s} {row['variant']:37s}"
              f" {row['clipping']:11s}"
              f" {str(row['jit']):5s}"
              f" {row['time_ratio']:7.2f} {row['cpu_time_ratio']:7.2f}"
              f" {row['memory_ratio']:7.2f}"
              f" {'n/a' if tensors is None else f'{tensors:.2f}':>10s}{note}")
    for r in results:
        if r.get("block_modes"):
            print(f"\nGhost clipping's blocks ({r['config']},"
                  f" {r['variant']}, jit={r['jit']}): layers by name")
            for line in _modes_summary(r["block_modes"],
                                       r.get("layer_rules")):
                print("  " + line)
    if FLAGS.output:
        with open(FLAGS.output, "w") as f:
            json.dump({"results": results, "ratios": rows}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
