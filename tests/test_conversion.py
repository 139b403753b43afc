"""flatten_mm/conversion.py: the first conv fitted to other image channels
by timm's rule, and only where it is an RGB model's weight for that conv."""
import pytest
import torch
from torch import nn

from flatten_mm.conversion import fit_input_conv


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
@pytest.mark.parametrize('channels', [1, 2, 4, 6])
def test_first_conv_fits_as_timm_adapts_it(channels, dtype):
    from timm.models import adapt_input_conv
    rgb = torch.randn(8, 3, 7, 7).to(dtype)
    fitted = fit_input_conv(rgb, nn.Conv2d(channels, 8, 7), 'w')
    assert fitted.dtype == dtype and fitted.shape == (8, channels, 7, 7)
    torch.testing.assert_close(fitted, adapt_input_conv(channels, rgb.clone()), rtol=0, atol=0)


def test_other_weights_are_left_for_the_load_to_report():
    rgb = torch.randn(8, 3, 7, 7)
    for weight, conv in ((rgb, nn.Conv2d(3, 8, 7)),  # nothing to fit
                         (rgb, nn.Conv2d(1, 16, 7)),  # another conv
                         (rgb, nn.Conv2d(1, 8, 3)),
                         (torch.randn(8, 4, 7, 7), nn.Conv2d(3, 8, 7)),  # not an RGB model's
                         (torch.randn(8, 3), nn.Conv2d(1, 8, 7))):
        assert fit_input_conv(weight, conv, 'w') is weight
