//! SGD with momentum, PyTorch semantics (`torch.optim.SGD`, dampening 0, no Nesterov): the weight decay is added
//! to the gradient, the first step seeds the momentum buffer with the gradient.

/// One SGD update of `p` in place; `buf` is the momentum buffer (`None` before the first step).
pub fn sgd_update(
    p: &mut [f32],
    g: &[f32],
    buf: &mut Option<Vec<f32>>,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
) {
    let (lr, mu, wd) = (lr as f32, momentum as f32, weight_decay as f32);
    if momentum == 0.0 {
        for (p, g) in p.iter_mut().zip(g) {
            let d = if wd != 0.0 { *g + wd * *p } else { *g };
            *p -= lr * d;
        }
        return;
    }
    let first = buf.is_none();
    let b = buf.get_or_insert_with(|| vec![0.0; p.len()]);
    for ((p, g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
        let d = if wd != 0.0 { *g + wd * *p } else { *g };
        *b = if first { d } else { *b * mu + d };
        *p -= lr * *b;
    }
}
