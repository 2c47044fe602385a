from student.train.trainer import TrainConfig, train  # noqa: F401
