"""Finding the plan: the legal space, bounds, the stage ILP and its exhaustive reference."""
from .driver import SOLVER_CHOICES, default_solver, search  # noqa: F401
from .enumerate import Candidate, SearchResult, evaluate  # noqa: F401
from .space import Knobs  # noqa: F401
