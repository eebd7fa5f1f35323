"""Triangular Toeplitz factors: d coefficients, products as convolutions.

A lower triangular Toeplitz matrix L(c) has L[i, k] = c[i - k] for i >= k and
0 above the diagonal; the upper form U(c) = L(c)ᵀ holds c[j] on the j-th
super-diagonal. Both families are closed under multiplication:
L(a) L(b) = L(a * b) and U(a) U(b) = U(a * b), with ``*`` the polynomial
product truncated to d terms.

Fast paths (no d x d temporary, O(n d log d) work) use real FFTs of a length
N >= 2d - 1 - 64 (a power of two where possible): circular convolutions equal
the linear ones on the d entries kept except at most 64 that wrap around,
which are computed directly:

- L(c) X is the causal convolution of c with each column of X, Lᵀ X the
  anticausal one: Lᵀ = J L J with J the reversal.
- Π̂(YᵀY): the j-th sub- (and super-) diagonal of YᵀY sums to the lag-j
  autocorrelation r_j = Σ_n Σ_i Y[n, i] Y[n, i + j], so c_0 = r_0 / d and
  c_j = 2 r_j / (d - j).
- Π̂(KᵀK): for K = L(c), (KᵀK)[i, k] = Σ_{t=0}^{d-1-i} c[t] c[t + j] with
  j = i - k >= 0; summing over the d - j entries of that diagonal counts the
  term c[t] c[t + j] once per i in [j, d - 1 - t], i.e. d - j - t = d - (t + j)
  times. So the diagonal sum is S_j = Σ_t c[t] w[t + j] c[t + j] with
  w[s] = d - s: a cross-correlation of c with w∘c. K = U(c) gives the same
  S_j (KᵀK = L Lᵀ = J (Lᵀ L) J, and the reversal maps the j-th diagonal onto
  the -j-th, which has the same sum for a symmetric matrix).

- K Kᵀ X (the preconditioner's product): both convolutions on each chunk of rows
  in one pass, with the spectrum of c computed once per factor update.

On the CPU the FFTs run over chunks of rows (a cache-sized working set).
Half-precision storage is upcast to float32 before any FFT; float64 stays in
float64.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import Tensor

from .base import SMALL_DENSE_DIM, StructuredMatrix, accumulation_dtype, upcast

# At most this many outputs of a product wrap around in the FFT's circular
# convolution and are computed directly (see _fft_length), and the last lags of an
# autocorrelation are summed directly (see _lagged_products_sum).
_DIRECT_TAIL = 64
# CPU FFTs run over chunks of rows whose padded signals hold about this many values
# (512 KiB in float32, the L2 cache of one core here: a chunk stays in cache through
# all its FFTs).
_CHUNK_ELEMENTS = 1 << 17


def _smooth_length(n: int) -> int:
    """The smallest 5-smooth integer >= n."""
    best = 1
    while best < n:
        best *= 2
    odd = 1  # runs over 3^a 5^b below best
    odd_factors = []
    while odd < best:
        five = odd
        while five < best:
            odd_factors.append(five)
            five *= 5
        odd *= 3
    for factor in odd_factors:
        candidate = factor
        while candidate < n:
            candidate *= 2
        best = min(best, candidate)
    return best


@functools.cache
def _fft_length(d: int) -> int:
    """The FFT length N for products of d-vectors: N >= 2d - 1 - _DIRECT_TAIL.

    A linear convolution of two d-vectors has 2d - 1 terms; a circular one of
    length N = 2d - 1 - e wraps the last e onto the first e outputs, which are then
    computed directly (e <= _DIRECT_TAIL). A power of two unless a 5-smooth length
    is clearly shorter: FFTs of other lengths run markedly slower (d = 513 with 1080
    points takes about 1.5x the time of d = 512 with 1024).
    """
    need = max(2 * d - 1 - _DIRECT_TAIL, 1)
    power = 1 << (need - 1).bit_length()
    smooth = _smooth_length(need)
    return smooth if 5 * smooth <= 4 * power else power


def _diagonal_sums(M: Tensor) -> Tensor:
    """s of length 2d - 1 with s[d - 1 + j] = Σ_{i - k = j} M[i, k], j in (-d, d).

    Flipping the columns and laying the rows out with stride 2d - 1 puts every
    diagonal of M into one column (the usual skew trick); O(d²) like M itself.
    """
    d = M.shape[0]
    padded = torch.nn.functional.pad(M.flip(1), (0, d))  # (d, 2d); entry (i, k) -> col d-1-k
    skewed = padded.reshape(-1)[: d * (2 * d - 1)].reshape(d, 2 * d - 1)
    # Row i of ``padded`` starts at 2d·i = (2d - 1)·i + i, so column d-1-k moves to d-1+(i-k).
    return skewed.sum(0)


def _rows_per_chunk(rows: int, row_values: int, device: torch.device) -> int:
    """Rows per batch of FFTs: on the CPU, about _CHUNK_ELEMENTS values of padded
    signal (``row_values`` per row; at least 8 rows), so that a chunk stays in cache;
    elsewhere all rows."""
    if device.type != "cpu":
        return max(rows, 1)
    return min(max(rows, 1), max(8, _CHUNK_ELEMENTS // row_values))


def _lower_dense(c: Tensor, e: int) -> Tensor:
    """The leading e x e block of L(c): entry (i, k) = c[i - k] for i >= k, else 0."""
    index = torch.arange(e, device=c.device)
    lag = index.unsqueeze(1) - index.unsqueeze(0)
    return torch.where(lag >= 0, c[lag.clamp_min(0)], c.new_zeros(()))


class _Convolver:
    """Products of L(c) (d x d, lower triangular Toeplitz) with the rows of a matrix.

    For a row x (1 x d), "conv" gives x L(c)ᵀ = (L(c) xᵀ)ᵀ, the causal convolution
    y[i] = Σ_{k<=i} c[k] x[i - k]; "corr" gives x L(c) = (L(c)ᵀ xᵀ)ᵀ, the
    correlation y[k] = Σ_m c[m] x[k + m], the same product with the conjugate
    spectrum of c. With N = 2d - 1 - e (see _fft_length) the circular convolution
    wraps onto the first e outputs of "conv" and the last e of "corr"; those involve
    only the first (last) e inputs and the leading e x e block of L(c), so they are
    recomputed from the input of each product. ``c`` is in the accumulation dtype.

    The signals are real rows (rfft) or, for the columns of a row-major matrix,
    pairs of columns as one complex signal x + i x' (fft): c is real, so the real and
    imaginary parts of the result are the two products. Reading the columns as
    8-byte pairs halves the strided accesses of the transposing copy that a
    row-major matrix needs. Each product's rounding error is relative to the norm
    of its signal, so a pair's results carry errors of the order of eps times the
    larger of the two columns.
    """

    def __init__(self, c: Tensor) -> None:
        self.coeffs = c
        self.d = c.shape[0]
        self.n_fft = _fft_length(self.d)
        self.wrap = max(0, 2 * self.d - 1 - self.n_fft)
        self.corner = _lower_dense(c, self.wrap) if self.wrap else None
        self._factors: dict[tuple[bool, str], tuple[Tensor, Tensor]] = {}

    def _factor(self, paired: bool, kind: str) -> tuple[Tensor, Tensor]:
        """(spectrum, wrap corner) of one product: the rfft of c (real signals) or its
        full fft (paired), conjugated for "corr"; the corner transposed for "conv"."""
        key = (paired, kind)
        if key not in self._factors:
            fft = torch.fft.fft if paired else torch.fft.rfft
            spectrum = fft(self.coeffs, n=self.n_fft)
            corner = self.corner
            if kind == "corr":
                spectrum = spectrum.conj().resolve_conj()
            elif corner is not None:
                corner = corner.T
            if paired and corner is not None:
                corner = corner.to(spectrum.dtype)
            self._factors[key] = (spectrum, corner)
        return self._factors[key]

    def _products(self, signal: Tensor, kinds: tuple[str, ...], paired: bool) -> Tensor:
        """The products ``kinds`` (in order) of the padded rows ``signal`` (rows, N),
        zero beyond column d; returns a new (rows, N) tensor, valid in its first d
        columns. ``signal`` is left unchanged."""
        d, n_fft, e = self.d, self.n_fft, self.wrap
        for i, kind in enumerate(kinds):
            spectrum, corner = self._factor(paired, kind)
            if i:
                signal[:, d:].zero_()  # the previous product's wrapped-around part
            # the outputs that wrap around, and where they go, from this product's input
            ends = slice(0, e) if kind == "conv" else slice(d - e, d)
            wrapped = signal[:, ends] @ corner if e else None
            # no out= here: torch's FFTs would compute into a temporary and copy
            if paired:
                signal = torch.fft.ifft(torch.fft.fft(signal).mul_(spectrum))
            else:
                signal = torch.fft.irfft(torch.fft.rfft(signal).mul_(spectrum), n=n_fft)
            if e:
                signal[:, ends] = wrapped
        return signal

    def _chunked(self, source: Tensor, out: Tensor, kinds: tuple[str, ...]) -> None:
        """out ← the products ``kinds`` of the rows of ``source`` (rows, d), over chunks
        of rows. A complex ``source`` holds pairs of signals; ``out`` is then (rows, 2, d),
        the real and imaginary parts of each result, else (rows, d)."""
        rows, d = source.shape
        if not rows:
            return  # (split would still give one, empty, chunk)
        paired = source.is_complex()
        step = _rows_per_chunk(rows, self.n_fft * (2 if paired else 1), source.device)
        # zero-padded input rows; copying into it beats the padding inside torch.fft
        padded = source.new_zeros((min(step, rows), self.n_fft))
        for chunk, target in zip(source.split(step), out.split(step), strict=True):
            signal = padded if chunk.shape[0] == step else padded[: chunk.shape[0]]
            signal[:, :d] = chunk
            result = self._products(signal, kinds, paired)[:, :d]
            target.copy_(torch.view_as_real(result).transpose(1, 2) if paired else result)

    def rows(self, X: Tensor, kinds: tuple[str, ...]) -> Tensor:
        """The products ``kinds`` ("conv" / "corr", in order) applied to every row of
        X (rows, d), any strides; returns a new contiguous (rows, d) tensor."""
        out = X.new_empty(X.shape)
        self._chunked(X, out, kinds)
        return out

    def columns(self, X: Tensor, kinds: tuple[str, ...]) -> Tensor:
        """The products ``kinds`` applied to every column of X (d, n), any layout;
        returns them as the rows of a new contiguous (n, d) tensor. Pairs of columns
        run as complex signals where X is row-major with n even (see the class)."""
        d, n = X.shape
        if not (X.is_contiguous() and n % 2 == 0 and X.storage_offset() % 2 == 0):
            return self.rows(X.T, kinds)
        pairs = torch.view_as_complex(X.view(d, n // 2, 2))  # (d, n/2): x_2j + i x_2j+1
        out = X.new_empty((n // 2, 2, d))
        self._chunked(pairs.T, out, kinds)
        return out.view(n, d)

    def apply(self, X: Tensor, kinds: tuple[str, ...]) -> Tensor:
        """The products ``kinds`` applied to X (d,) or to the columns of X (d, n): a new
        (d,) tensor, or the transposed view of a new contiguous (n, d) tensor (so that
        K.rmatmul(a.T).T comes back contiguous)."""
        if X.dim() == 1:
            return self.rows(X.unsqueeze(0), kinds)[0]
        return self.columns(X, kinds).T


def _power_spectrum_sum(Y: Tensor, n_fft: int) -> Tensor:
    """Σ_rows |rfft(y, n_fft)|² over the rows y of Y (n, d), chunk by chunk."""
    rows, d = Y.shape
    total = Y.new_zeros(n_fft // 2 + 1)
    # twice the rows of a product's chunk: no inverse FFT's output to keep in cache
    step = _rows_per_chunk(rows, n_fft // 2, Y.device)
    padded = Y.new_zeros((min(step, rows), n_fft))
    for start in range(0, rows, step):
        chunk = Y[start : start + step]
        signal = padded[: chunk.shape[0]]
        signal[:, :d] = chunk
        power = torch.view_as_real(torch.fft.rfft(signal)).square_()  # (rows, bins, 2)
        total += power.sum(0).sum(-1)  # one dimension at a time: much faster than (0, 2)
    return total


def _lagged_products_sum(a: Tensor, b: Tensor) -> Tensor:
    """r[j] = Σ_rows Σ_t a[.., t] b[.., t + j] for j in [0, d), along the last dim.

    The FFT's error is about eps · r[0] / sqrt(d) on every lag, which the last
    lags (few terms, later divided by d - j) would feel most; those lags, and
    all of them for small d, come from the m x m corner aᵀ[:m] b[d-m:] instead.
    """
    d, same = a.shape[-1], b is a
    a, b = a.reshape(-1, d), b.reshape(-1, d)
    m = min(d, _DIRECT_TAIL)
    # corner[p, q] pairs t = p with t + j = d - m + q: lag j = d - m + (q - p).
    corner = a[:, :m].T @ b[:, d - m :]
    tail = _diagonal_sums(corner.T)[m - 1 :]
    if m == d:
        return tail
    n_fft = _fft_length(d)  # >= 2d - 1 - m: lags below d - m do not wrap
    if same:
        # Summing the spectra over the rows first needs one inverse FFT only.
        spectrum = _power_spectrum_sum(a, n_fft)
    else:
        spectrum = (torch.fft.rfft(a, n=n_fft).conj() * torch.fft.rfft(b, n=n_fft)).sum(0)
    return torch.cat((torch.fft.irfft(spectrum, n=n_fft)[: d - m], tail))


def _coeffs_from_symmetric_sums(sums: Tensor, d: int) -> Tensor:
    """Π̂ coefficients from the j-th diagonal sums (j >= 0) of a symmetric matrix."""
    counts = torch.arange(d, 0, -1, dtype=sums.dtype, device=sums.device)  # d - j
    scale = torch.full_like(sums, 2.0)
    scale[0] = 1.0
    return sums * scale / counts


class _TriangularToeplitz(StructuredMatrix):
    """Shared implementation; ``lower`` picks the triangle. Part ``coeffs``: (d,)."""

    part_names = ("coeffs",)
    lower: ClassVar[bool]
    # K Kᵀ is not Toeplitz, but it multiplies as two FFT products (d <= 128: dense)
    structured_times_transpose = True

    # ------------------------------------------------------------- constructors
    @classmethod
    def from_dense(cls, M: Tensor) -> _TriangularToeplitz:
        d = M.shape[0]
        M_acc = upcast(M)
        # Average each diagonal as its first entry plus the mean deviation from it, so a
        # diagonal that is already constant comes back bit for bit.
        first = torch.cat((M_acc[0].flip(0), M_acc[1:, 0]))  # first[d - 1 + (i - k)]
        index = torch.arange(d, device=M.device)
        lag = index.unsqueeze(1) - index.unsqueeze(0) + (d - 1)
        sums = _diagonal_sums(M_acc - first[lag])
        if cls.lower:
            offsets, first = sums[d - 1 :], first[d - 1 :]
        else:
            offsets, first = sums[:d].flip(0), first[:d].flip(0)
        counts = torch.arange(d, 0, -1, dtype=offsets.dtype, device=M.device)
        return cls(d, coeffs=(first + offsets / counts).to(M.dtype))

    @classmethod
    def project(cls, M: Tensor) -> _TriangularToeplitz:
        d = M.shape[0]
        sums = _diagonal_sums(upcast(M))
        # (sub-diagonal sum + super-diagonal sum) / 2: exact for a symmetric M.
        symmetric_sums = (sums[d - 1 :] + sums[:d].flip(0)) / 2
        return cls(d, coeffs=_coeffs_from_symmetric_sums(symmetric_sums, d).to(M.dtype))

    @classmethod
    def project_gram(cls, Y: Tensor) -> _TriangularToeplitz:
        d = Y.shape[1]
        Y_acc = upcast(Y)
        autocorrelation = _lagged_products_sum(Y_acc, Y_acc)
        return cls(d, coeffs=_coeffs_from_symmetric_sums(autocorrelation, d).to(Y.dtype))

    @classmethod
    def eye(cls, d: int, dtype: torch.dtype = torch.float32, device=None) -> _TriangularToeplitz:
        coeffs = torch.zeros(d, dtype=dtype, device=device)
        coeffs[:1] = 1
        return cls(d, coeffs=coeffs)

    # ------------------------------------------------------------------ instance
    def to_dense(self) -> Tensor:
        c = self.parts["coeffs"]
        d = self.dim
        index = torch.arange(d, device=c.device)
        lag = index.unsqueeze(1) - index.unsqueeze(0)  # i - k
        if not self.lower:
            lag = -lag
        return torch.where(
            lag >= 0, c[lag.clamp_min(0)], torch.zeros((), dtype=c.dtype, device=c.device)
        )

    def _apply(self, X: Tensor, transpose: bool) -> Tensor:
        """L(c) X, or L(c)ᵀ X with ``transpose`` (c = coeffs; U(c) = L(c)ᵀ)."""
        out_dtype = torch.promote_types(self.dtype, X.dtype)
        acc = accumulation_dtype(out_dtype)
        c, X_acc = upcast(self.parts["coeffs"], acc), upcast(X, acc)
        if self.dim <= SMALL_DENSE_DIM:  # the dense matrix beats two FFTs there
            T = TrilToeplitz(self.dim, coeffs=c).to_dense()
            return ((T.T if transpose else T) @ X_acc).to(out_dtype)
        kinds = ("corr",) if transpose else ("conv",)
        return _Convolver(c).apply(X_acc, kinds).to(out_dtype)

    def matmul(self, X: Tensor) -> Tensor:
        return self._apply(X, transpose=not self.lower)

    def rmatmul(self, X: Tensor) -> Tensor:
        return self._apply(X, transpose=self.lower)

    def __matmul__(self, other: StructuredMatrix) -> _TriangularToeplitz:
        self._check_same_structure(other)
        acc = accumulation_dtype(self.dtype, other.dtype)
        a = upcast(self.parts["coeffs"], acc)
        b = upcast(other.parts["coeffs"], acc)
        if self.dim <= SMALL_DENSE_DIM:
            product = TrilToeplitz(self.dim, coeffs=a).to_dense() @ b
        else:
            product = _Convolver(a).rows(b.unsqueeze(0), ("conv",))[0]
        return type(self)(self.dim, coeffs=product.to(self.dtype))

    def times_transpose(self):
        """K Kᵀ as an operator: L Lᵀ X (lower) or Lᵀ L X (upper) as two FFT products
        per row of Xᵀ, with the spectrum of c computed once (dense for small d)."""
        if self.dim <= SMALL_DENSE_DIM:
            return super().times_transpose()
        return _ToeplitzGram(self.parts["coeffs"], self.lower)

    def project_inner(self) -> _TriangularToeplitz:
        d = self.dim
        c = upcast(self.parts["coeffs"])
        weights = torch.arange(d, 0, -1, dtype=c.dtype, device=c.device)  # w[s] = d - s
        diagonal_sums = _lagged_products_sum(c, weights * c)
        return type(self)(d, coeffs=_coeffs_from_symmetric_sums(diagonal_sums, d).to(self.dtype))

    def trace(self) -> Tensor:
        c = upcast(self.parts["coeffs"])
        return c[0] * self.dim if self.dim else c.sum()


class _ToeplitzGram:
    """K Kᵀ for K = L(c) (``lower``) or U(c) = L(c)ᵀ, d > SMALL_DENSE_DIM, kept in the
    accumulation dtype of c: ``matmul(X)`` runs both products in one pass over the
    rows of Xᵀ, through cache-sized FFT buffers, and allocates its result only."""

    def __init__(self, coeffs: Tensor, lower: bool) -> None:
        self.dim = coeffs.shape[0]
        self.coeffs = upcast(coeffs)
        self.convolver = _Convolver(self.coeffs)
        # row x of Xᵀ: x (L Lᵀ)ᵀ = x L Lᵀ is "corr" then "conv"; x Lᵀ L the other way
        self.kinds = ("corr", "conv") if lower else ("conv", "corr")

    @property
    def dtype(self) -> torch.dtype:
        return self.coeffs.dtype

    def matmul(self, X: Tensor) -> Tensor:
        """(K Kᵀ) X for X (d, n) or (d,): for a matrix, the transposed view of a new
        contiguous (n, d) tensor; dtype promote(accumulation dtype, X)."""
        acc = accumulation_dtype(self.dtype, X.dtype)
        convolver = self.convolver if acc == self.dtype else _Convolver(self.coeffs.to(acc))
        return convolver.apply(upcast(X, acc), self.kinds)

    def to_dense(self) -> Tensor:
        return self.matmul(torch.eye(self.dim, dtype=self.dtype, device=self.coeffs.device))


class TrilToeplitz(_TriangularToeplitz):
    """Lower triangular Toeplitz: coeffs[j] on the j-th sub-diagonal."""

    name = "tril_toeplitz"
    lower = True


class TriuToeplitz(_TriangularToeplitz):
    """Upper triangular Toeplitz: coeffs[j] on the j-th super-diagonal (= TrilToeplitz ᵀ)."""

    name = "triu_toeplitz"
    lower = False
