"""Detection: error classification, the statistical step monitor, the stall check and the
straggler rule. Pure decisions, no I/O.
"""
