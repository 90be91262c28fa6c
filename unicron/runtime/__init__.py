"""The worker's data path: process groups per epoch, the exact reduce, the micro-batch
ledger, state transfer, checkpoints, devices, the worker's link to its agent, the zygote
launcher, the health probe and fault injection.
"""
