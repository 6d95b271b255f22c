from ._sampler import QDQMutationSampler

__all__ = ["QDQMutationSampler"]
