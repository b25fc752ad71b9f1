"""The megatron-core trainer: model building and HF weight conversion (model), batch layouts
(layout), RL losses (loss), and the training engine (engine). Import submodules directly; this
package imports nothing heavy on its own."""
