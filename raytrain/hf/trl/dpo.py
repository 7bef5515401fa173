class DPOMethods:  # placeholder
    pass
