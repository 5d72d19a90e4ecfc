"""Spikes on purpose and what a run does about them, one room each: ``injections`` (deterministic
spikes as trainer callbacks), ``policies`` (the recovery playbook's reactions to what the
detector flags), ``records`` (what a branch keeps of its steps) and ``branch`` (the driver that
runs a policy from a spike's origin to the end of its window, in segments)."""
