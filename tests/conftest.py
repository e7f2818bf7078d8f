"""Shared test setup: JAX on the CPU (libtpu's compile-only TPU7x devices still work), and the
Hypothesis profile.

Hypothesis profiles (MKDSL_HYPOTHESIS_PROFILE):
* `ci` (the default, what `python -m pytest` and `.ci/run` use): derandomised — every run draws
  the same examples from a seed derived from each test, with no example database — so a CI run is
  reproducible on any machine.
* `dev`: a random search (new examples every run, the local example database replaying failures),
  for developers hunting bugs: `MKDSL_HYPOTHESIS_PROFILE=dev python -m pytest tests/test_ops_oracle.py`.
Tests keep their own `max_examples` and `deadline`; the profile decides only where examples come from.
"""

import os

from hypothesis import settings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a machine-wide lock; compile-only use from a second process (a dev server, a
# parallel run) must not make the compile tests fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Eight virtual CPU devices, so sharded kernels run over a real mesh in interpret mode (tests of
# one-device kernels use the first), and XLA:CPU's fast-compile flags (tests/xla_cpu.py: about
# half the suite's compile time). Must be set before JAX initialises its CPU backend.
from xla_cpu import xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = xla_flags(8, os.environ.get("XLA_FLAGS", ""))

# Tests that build `pltpu.InterpretParams()` themselves get what mkdsl installs wherever it asks
# for interpret mode (mkdsl/backends/tpu/interpret.py): the host path for the interpreter's
# callbacks (2.5-3.5x faster interpreted steps, and no multi-device deadlock) and the vectorised
# race detector (mkdsl/backends/tpu/race_detection.py).
from mkdsl.backends.tpu.interpret import use_fast_interpreter  # noqa: E402

use_fast_interpreter()

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("MKDSL_HYPOTHESIS_PROFILE", "ci"))


# The slow tests (each a minute or more on 2 cores: interpret-mode megakernels, libtpu compiles of
# full-size kernels, the sharded lockstep models). `python -m pytest -m "not slow"` is the fast
# subset; CI runs everything. Marked here, in one place, by module or by test name.
SLOW_MODULES = {
    "test_qwen3_next_compile.py",
    "test_kimi_kernel.py",
    "test_kimi_compile.py",
    "test_kimi_sharded_compile.py",
    "test_tpu_compile.py",
    "test_kernel_interpret.py",
    "test_verify.py",
    "test_kernel_elementwise.py",
    "test_qwen3_compile.py",
    "test_moe_kernel.py",
    "test_quant_compile.py",
    "test_deepseek_v3_compile.py",
    "test_gpt_oss_compile.py",
}
SLOW_TESTS = {
    "test_gdn_kernel.py": ("test_gated_deltanet_kernel_matches_reference",),
    "test_qwen3_next.py": ("test_mini_kernel_matches_reference",),
    "test_quant_linear.py": (  # TPU interpret-mode kernels, ~25-30 s each
        "test_every_weight_format_streams_and_matches_the_reference",
        "test_padded_outputs_a_tied_head_and_a_split_vocabulary_match_the_reference",
    ),
    "test_bench.py": ("test_bench_on_a_cpu_runs_interpret_mode_and_says_so",),  # a tiny kernel in interpret mode
    "test_prefill.py": (  # tiny's kernel in interpret mode (two builds), Kimi mini prefill on 8 devices
        "test_prefill_then_kernel_decode_equals_kernel_decoding_the_prompt",
        "test_kernel_samples_as_the_reference_and_n_steps_per_call_equal_n_calls",
        "test_kimi_mini_sharded_prefill_matches_decode_layer_by_layer",
    ),
    "test_sampling.py": ("test_the_kernel_draws_as_the_reference_over_a_split_vocabulary",),  # 8 devices, interpret
    "test_comm.py": (
        "test_collectives_interpret_8_devices",
        "test_collectives_compile_tpu7x",
        "test_adjacent_all_reduces_run_fused_and_match_the_reference",
    ),
    "test_shard.py": ("test_per_device_models_in_lockstep_match_the_reference",),
    "test_attention_kernel.py": (
        "test_window_sinks_rope_variants_head_dims_and_mla_match_the_reference",
        "test_kernels_compile_with_libtpu",
    ),
    "test_mla_kernel.py": ("test_many_heads_on_one_device_match_the_reference",),  # interpret mode, ~20 s
    "test_qwen3.py": ("test_mini_kernel_matches_reference_sharded_interpret",),
    "test_gpt_oss.py": ("test_mini_kernel_matches_reference_sharded_interpret",),
    "test_deepseek_v3.py": ("test_mini_kernel_matches_reference_sharded_interpret",),
    # the specs written as a new user would (issue 10's last point): one mini kernel each, ~25 s
    "test_gemma3.py": ("test_mini_kernel_matches_reference_sharded_interpret",),
    "test_mixtral.py": ("test_mini_kernel_matches_reference_sharded_interpret",),
    "test_qwen2_5.py": ("test_mini_kernel_matches_reference_sharded_interpret",),
    "test_olmo2.py": ("test_mini_kernel_matches_reference_sharded_interpret",),
    "test_phi3.py": ("test_mini_kernel_matches_reference_sharded_interpret",),
    "test_deepseek_v2_lite.py": ("test_mini_kernel_matches_reference_sharded_interpret",),
    "test_run.py": (  # interpret-mode kernels of the Llama mini from a checkpoint
        "test_loaded_weights_run_a_kernel_step_equal_to_the_reference",
        "test_run_streams_text_and_closes_with_timings",
    ),
    "test_smollm2.py": ("test_kernel_greedy_decode_equals_the_reference_and_a_numpy_decode",),
    "test_spec_gen.py": ("test_random_spec_kernel_matches_reference", "test_pinned_cases_kernel_matches_reference"),
    "test_docs.py": (  # each runs a kernel or the compiler in a subprocess
        "test_python_api_examples_run",
        "test_readme_quickstart_runs_as_written",
        "test_adding_an_op_example_touches_only_its_files_and_compiles",
    ),
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test of a minute or more (deselect with -m 'not slow')")


def pytest_unconfigure(config):
    """Freeze the heap before pytest's closing garbage collections (five full passes to report
    unraisable exceptions): over a worker's JAX objects they took ~18 s after a single Kimi K3
    test (py-spy), for nothing a test asserts; objects created after the freeze are still collected."""
    import gc

    gc.freeze()


def pytest_collection_modifyitems(config, items):
    import pytest
    from suite_order import heaviest_first, load_table

    for item in items:
        module = item.path.name
        if module in SLOW_MODULES or item.originalname in SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)
    # Heaviest files first, so that both xdist workers finish together (tests/suite_order.py).
    slow = [i.get_closest_marker("slow") is not None for i in items]
    order = heaviest_first([i.nodeid for i in items], slow, load_table())
    items[:] = [items[i] for i in order]
