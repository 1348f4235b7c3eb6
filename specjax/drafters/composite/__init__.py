"""Composite drafters: several drafters (or one, reshaped) behind the ordinary protocol, so the engine
loop does not know they are there. `treegraft` (a cheap tree rescored and grafted by a strong drafter,
with `treegraft_scheduler`, its distilled MLP), `switch` (the n-gram's chain when it matches, the model drafter's
tree otherwise), `adaptive` (a drafter's tree cut per round from calibrated acceptance)."""
