"""A diffusion-style UNet: timestep embedding, ResBlocks, attention, skips, ConvTranspose2d, upsampling."""
import sys

from common import single_call_example
import zoo

if __name__ == "__main__":
    model, args = zoo.unet()
    sys.exit(single_call_example("unet", "diffusion UNet (32x32, timestep embedding, mid attention)", model, args))
