"""Finding the plan: the legal space, bounds, the stage ILP and its exhaustive reference."""
from ..estimate import Candidate  # noqa: F401
from .driver import SOLVER_CHOICES, default_solver, evaluate, search  # noqa: F401
from .result import SearchResult  # noqa: F401
from .space import Knobs  # noqa: F401
