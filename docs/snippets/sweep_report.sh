python -m raytrain.report runs/digits/sweeps/digits    # every trial's objective: runs/digits/sweeps/digits/plots/objective.png
