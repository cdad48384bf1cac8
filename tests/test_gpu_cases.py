"""The GPU tests' cases, checked on CPU: every configuration a Hopper kernel case names is one that
kernel still takes (the post-norm, split post-norm and GEMM + elementwise kernels).

Why: the GPU tests run only on the device, some sessions not at all, so a case that a later
change makes the kernel refuse (or, before :class:`WgmmaConfig`'s options were keyword-only, a
positional case that a new field silently re-meant) fails there first, sessions later (session
33: seven split post-norm cases written before ``turns`` refused as ``turns = True``). Here CI
sees it.
"""

import dataclasses

import pytest

import test_gpu  # the GPU cases (its tests are collected there, not here)
from tvm_comfuse.schedule import split_norm as sn, wgmma_elementwise as we, wgmma_postnorm as wp


def _cases(test):
    """``test``'s parametrized cases that name a configuration, each a dict of argument names to values."""
    mark = next(m for m in test.pytestmark if m.name == "parametrize")
    argnames = [a.strip() for a in mark.args[0].split(",")]
    cases = [dict(zip(argnames, case)) for case in mark.args[1]]
    return [case for case in cases if case["cfg"] is not None]


@pytest.mark.parametrize("case", _cases(test_gpu.test_gpu_wgmma_postnorm_matches_torch))
def test_postnorm_cases_are_configurations_the_kernel_takes(case):
    spec = wp.PostNorm.suite(case["dtype"], case["norm"])
    found = wp.problems(case["M"], case["N"], case["K"], spec, test_gpu._config(case["cfg"]), case["stage"])
    assert not found, found


@pytest.mark.parametrize("case", _cases(test_gpu.test_gpu_split_postnorm_matches_torch))
def test_split_postnorm_cases_are_configurations_the_kernel_takes(case):
    spec = dataclasses.replace(wp.PostNorm.suite(case["dtype"], case["norm"]), norm_out=case["norm_out"])
    found = sn.problems(case["M"], case["N"], case["K"], spec, test_gpu._config(case["cfg"]))
    assert not found, found


@pytest.mark.parametrize("case", _cases(test_gpu.test_gpu_wgmma_elementwise_matches_torch))
def test_elementwise_cases_are_configurations_the_kernel_takes(case):
    spec = test_gpu._chain_spec(case["chain"], case["dtype"], case["N"], case["lead"], case["axes"])
    found = we.problems(case["M"], case["N"], case["K"], spec, test_gpu._config(case["cfg"]))
    assert not found, found
