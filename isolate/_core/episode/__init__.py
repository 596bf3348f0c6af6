"""One episode, stage by stage: the arguments checked, the preparation, the start of the
child, what is observed of it, the verdict and the outcome (``launcher.run_episode``)."""
