# Dev worktree: drop the editable install's finder so that PYTHONPATH (this worktree) provides zinf.
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
