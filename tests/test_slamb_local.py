"""Single-process checks of the Slamb rule's options and its refusal of unsafe set-ups."""

import numpy as np
import pytest

import slamb_comm as sc
from slamb_comm.slamb import Slamb


def test_float16_parameters_need_a_float32_master_copy():
    x = [np.zeros((100, 100), np.float16)]
    with pytest.raises(sc.ConfigError, match="float32 master copy"):
        Slamb(sc.Communicator(None, x))


@pytest.mark.parametrize("kw", [dict(betas=(1.0, 0.999)), dict(beta3=1.0), dict(sync_interval=0),
                                dict(c_min=0.0), dict(eps=-1.0), dict(lr=-0.1), dict(lr=[0.1, 0.2]),
                                dict(on_nonfinite="ignore")])
def test_bad_options_raise_config_error(kw):
    x = [np.zeros((100, 100), np.float32)]
    with pytest.raises(sc.ConfigError):
        Slamb(sc.Communicator(None, x), **kw)


def test_skipped_step_leaves_state_untouched_in_one_process():
    x = [np.ones((100, 100), np.float32)]
    opt = Slamb(sc.Communicator(None, x, ratio=0.1), lr=0.01)
    opt.step(x, [np.ones((100, 100), np.float32)])
    before = opt.state_dict(), x[0].copy()
    g = np.ones((100, 100), np.float32)
    g[3, 4] = np.inf
    opt.step(x, [g])
    assert opt.skipped_steps == 1 and opt.t == 1
    after = opt.state_dict()
    for k in ("m", "v", "f"):
        np.testing.assert_array_equal(after[k], before[0][k])
    np.testing.assert_array_equal(x[0], before[1])
