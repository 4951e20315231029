// CPU emulation: the runtime API is cuda_runtime.h's.
#pragma once
#include "cuda_runtime.h"
