"""One home per model family: its names, its config rules and its published facts, without torch.

Preflight, the engine's build plan and bridges, parity, the benchmarks and the tests read a family's facts here
(``glm5/``: GLM-5 and GLM-5.2), so that the next model, or the next version of one, changes one folder.
"""
