"""Composite drafters: several drafters (or one, reshaped) behind the ordinary protocol, so the engine
loop does not know they are there. `treegraft` (a cheap and a strong drafter, per round and row one
action: the cheap chain, the strong tree, a graft, a recovered subtree or their union, picked by a policy:
`treegraft_scheduler`'s distilled MLP, or the Switch's rule: the n-gram's chain when it matches, the model
drafter's tree otherwise), `adaptive` (a drafter's tree cut per round from calibrated acceptance)."""
