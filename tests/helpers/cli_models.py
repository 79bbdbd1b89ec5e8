"""Factories for CLI tests: `torchtpu-export cli_models:NAME ...` with tests/helpers/ on the path."""
import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.tanh(self.l(x))


def tiny():
    torch.manual_seed(0)
    return Tiny(), (torch.randn(2, 4),)


class Nonzero(torch.nn.Module):
    def forward(self, x):
        # nonzero's row count depends on the data: fine as an output, not as another op's input
        return torch.nonzero(x > 0).sum()


def unsupported():
    return Nonzero(), (torch.randn(4),)


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def data_dependent():
    return DataDependent(), (torch.randn(4),)


def not_a_model():
    return 42
