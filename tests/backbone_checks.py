"""Checks every dense backbone must pass, shared by the backbone tests."""
import torch


def assert_cp_gives_same_gradients(make, x):
    """``make(**kw)`` builds a backbone; with_cp must not change gradients."""
    a = make(drop_path_rate=0.)
    b = make(drop_path_rate=0., with_cp=True)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        sum(o.square().sum() for o in m(x)).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-6, msg=name)


def assert_autocast_finite(model, dtype, x):
    """Half-precision autocast stays finite and within 5% of fp32."""
    model.eval()
    with torch.no_grad():
        ref = model(x)
        with torch.autocast('cpu', dtype=dtype):
            outs = model(x)
    for o, r in zip(outs, ref):
        assert torch.isfinite(o).all()
        assert ((o.float() - r).norm() / r.norm()).item() < 0.05
