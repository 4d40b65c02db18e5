export PYTHONPATH=/work/wt-me/.dev:/work/wt-me/core:/work/wt-me
