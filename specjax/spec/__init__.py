"""What a speculative round is made of, independent of any model: draft trees and their specs
(`tree`, `tree_spec`), verification rules (`verify`), sampling parameters (`sampling`), verify widths
(`widths`), acceptance calibrations (`calibration`) and the machine's cost tables (`profile`).

Layer: imports nothing from specjax but `specjax.typing`."""
