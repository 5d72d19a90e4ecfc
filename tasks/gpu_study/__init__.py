"""The gpu profile's ablation study, trained in short GPU windows: planned here (flows/gpu_study.py,
the slices: :mod:`tasks.gpu_study.plan`), each slice trained on a lent GPU machine with only torch,
numpy and pyyaml (:mod:`tasks.gpu_study.window`), brought back as one file and accumulated here
(:mod:`tasks.gpu_study.state`). docs/gpu-study.md walks a window through."""
