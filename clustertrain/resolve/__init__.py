"""A config settled on a world, before any process starts: loaded and checked against the model
(`resolve.load`), the optional packages it needs (`resolve.packages`), then the layout, fixed or chosen by the
planner, the parameter dtype, the paths and the batch (`resolve.run`: one frozen `Resolved`), and once the data is
counted, the steps of `train.epochs` (`resolve.epochs`). The trainer, `plan`, `config show|check` and `doctor`
all take a `Resolved`."""
