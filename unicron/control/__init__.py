"""The control plane: the coordinator (membership, detection, decisions), the node agent,
the escalation policy, the protocol between them, the event log, ``unicron run`` and its
report.
"""
