//! Palettization: the k-means, whole checkpoints and recipes, and calibrated packages.

mod calibrated;
mod checkpoint;
mod kmeans;
