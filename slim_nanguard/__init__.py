"""slim_nanguard: keeps TF-Slim training alive and honest when the loss or gradients turn NaN/Inf."""
