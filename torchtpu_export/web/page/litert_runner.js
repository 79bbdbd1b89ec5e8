// Loads .tflite models with LiteRT.js (WASM backend) and runs them on typed arrays.
// Shared by index.html (any model), classify.html (the image demo) and driver.mjs (tests).
import {loadAndCompile, loadLiteRt, supportsFeature, Tensor} from '@litertjs/core';

// Served by `torchtpu-export serve-web` out of node_modules: never a CDN.
export const WASM_DIR = '/vendor/@litertjs/core/wasm/';

// The dtypes a LiteRT.js Tensor can hold (its DATATYPES table in @litertjs/core 2.5).
export const ARRAYS = {float32: Float32Array, int32: Int32Array, uint8: Uint8Array};

let liteRtLoading = null;
export const runtime = {threads: false};

/**
 * Loads the LiteRT.js wasm module once per page: the multi-threaded build where the page is
 * cross-origin isolated (serve-web sends the COOP/COEP headers that SharedArrayBuffer needs)
 * and the browser has wasm threads and relaxed SIMD (unless the URL says ?threads=0), else the
 * single-threaded one.
 */
export function initLiteRt(wasmDir = WASM_DIR) {
  liteRtLoading ??= (async () => {
    const allowed = new URLSearchParams(globalThis.location?.search ?? '').get('threads') !== '0';  // ?threads=0
    runtime.threads = allowed && Boolean(globalThis.crossOriginIsolated) && await supportsFeature('relaxedSimd') &&
        await supportsFeature('threads');
    return loadLiteRt(wasmDir, {threads: runtime.threads});
  })();
  return liteRtLoading;
}

function detailsOf(d) {
  return {name: d.name, dtype: d.dtype, shape: Array.from(d.shape)};
}

/** Fetches and compiles a model; returns {model, signatures, bytes, timings}. */
export async function loadModel(url, accelerator = 'wasm') {
  await initLiteRt();
  const t0 = performance.now();
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  const bytes = new Uint8Array(await response.arrayBuffer());
  const t1 = performance.now();
  let model;
  try {
    model = await loadAndCompile(bytes, {accelerator});
  } catch (e) {
    const msg = String(e?.message ?? e);
    if (/Element type .* is not supported/.test(msg)) {
      throw new Error(`${url}: ${msg} LiteRT.js tensors are ${Object.keys(ARRAYS).join(', ')}; ` +
                      'reconvert for the web with tte.convert(..., io_dtypes="web").');
    }
    throw new Error(`${url}: LiteRT.js could not load the model: ${msg}`);
  }
  const t2 = performance.now();
  const signatures = {};
  for (const [key, runner] of Object.entries(model.signatures)) {
    signatures[key] = {inputs: runner.getInputDetails().map(detailsOf),
                       outputs: runner.getOutputDetails().map(detailsOf)};
  }
  return {model, url, bytes: bytes.length, signatures, defaultSignature: model.key, threads: runtime.threads,
          timings: {fetchMs: t1 - t0, compileMs: t2 - t1}};
}

function numel(shape) {
  return shape.reduce((a, b) => a * b, 1);
}

/** Random inputs for a signature: normal floats, small non-negative integers (valid token ids). */
export function randomInputs(spec, seed = 0) {
  let s = seed >>> 0 || 1;
  const next = () => ((s = (s * 1664525 + 1013904223) >>> 0) / 4294967296);
  const out = {};
  for (const inp of spec.inputs) {
    const data = new ARRAYS[inp.dtype](numel(inp.shape));
    for (let i = 0; i < data.length; i++) {
      data[i] = inp.dtype === 'float32'
          ? Math.sqrt(-2 * Math.log(next() + 1e-12)) * Math.cos(2 * Math.PI * next())
          : Math.floor(next() * 8);
    }
    out[inp.name] = {dtype: inp.dtype, shape: inp.shape, data};
  }
  return out;
}

/**
 * Runs one signature on {name: {dtype, shape, data: TypedArray}}.
 * Returns {outputs: {name: {dtype, shape, data}}, firstRunMs, runMs: [...]} where the first
 * run is timed apart (it includes one-time setup) and `repeats` more runs follow it.
 */
export async function runModel(loaded, inputs, {signature = null, repeats = 0} = {}) {
  const key = signature ?? loaded.defaultSignature;
  const spec = loaded.signatures[key];
  if (!spec) throw new Error(`no signature ${key}; the model has ${Object.keys(loaded.signatures).join(', ')}`);
  const tensors = {};
  try {
    for (const inp of spec.inputs) {
      const given = inputs[inp.name];
      if (!given) throw new Error(`missing input ${inp.name}`);
      if (given.dtype !== inp.dtype) throw new Error(`input ${inp.name} is ${given.dtype}, the model takes ${inp.dtype}`);
      if (given.shape.join('x') !== inp.shape.join('x')) {
        throw new Error(`input ${inp.name} has shape [${given.shape}], the model takes [${inp.shape}]`);
      }
      tensors[inp.name] = new Tensor(given.data, inp.shape);
    }
    const times = [];
    let outputs = null;
    for (let r = 0; r <= repeats; r++) {
      const t0 = performance.now();
      const result = await loaded.model.run(key, tensors);
      const read = {};
      for (const out of spec.outputs) {
        read[out.name] = {dtype: out.dtype, shape: out.shape, data: await result[out.name].data()};
      }
      times.push(performance.now() - t0);
      for (const t of Object.values(result)) t.delete();
      outputs = read;
    }
    return {signature: key, outputs, firstRunMs: times[0], runMs: times.slice(1)};
  } finally {
    for (const t of Object.values(tensors)) t.delete();
  }
}

export function median(xs) {
  if (!xs.length) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
}

// ---- bytes <-> typed arrays (for the test driver, which passes base64 through page.evaluate) ----

export function toBase64(typed) {
  const bytes = new Uint8Array(typed.buffer, typed.byteOffset, typed.byteLength);
  let s = '';
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

export function fromBase64(b64, dtype) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const Ctor = ARRAYS[dtype];
  if (!Ctor) throw new Error(`dtype ${dtype} is not one LiteRT.js tensors hold (${Object.keys(ARRAYS).join(', ')})`);
  return new Ctor(bytes.buffer);
}

// ---- .npy files (for inputs given with `serve-web --inputs` or picked in the page) ----

const NPY_DTYPES = {'<f4': Float32Array, '<i4': Int32Array, '|u1': Uint8Array, '<f8': Float64Array,
                    '<i8': BigInt64Array, '|b1': Uint8Array, '<u4': Uint32Array};

/** Parses a little-endian, C-order .npy file into {dtype: numpy descr, shape, data}. */
export function parseNpy(buffer) {
  const bytes = new Uint8Array(buffer);
  if (bytes[0] !== 0x93 || String.fromCharCode(...bytes.subarray(1, 6)) !== 'NUMPY') throw new Error('not a .npy file');
  const major = bytes[6];
  const view = new DataView(buffer);
  const headerLen = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = major === 1 ? 10 : 12;
  const header = new TextDecoder().decode(bytes.subarray(start, start + headerLen));
  const descr = /'descr':\s*'([^']+)'/.exec(header)?.[1];
  const fortran = /'fortran_order':\s*True/.test(header);
  const shape = (/'shape':\s*\(([^)]*)\)/.exec(header)?.[1] ?? '').split(',').filter(s => s.trim()).map(Number);
  const Ctor = NPY_DTYPES[descr];
  if (!Ctor || fortran) throw new Error(`.npy with dtype ${descr}${fortran ? ' (Fortran order)' : ''} is not supported`);
  const offset = start + headerLen;
  return {dtype: descr, shape, data: new Ctor(buffer.slice(offset, offset + numel(shape) * Ctor.BYTES_PER_ELEMENT))};
}

/** Casts a parsed .npy array to a model input's dtype, refusing integers that do not fit. */
export function npyToInput(npy, inp) {
  if (npy.shape.join('x') !== inp.shape.join('x')) {
    throw new Error(`${inp.name}: the file has shape [${npy.shape}], the model takes [${inp.shape}]`);
  }
  const Ctor = ARRAYS[inp.dtype];
  if (npy.data instanceof Ctor && !(npy.dtype === '|b1' && inp.dtype !== 'uint8')) {
    return {dtype: inp.dtype, shape: inp.shape, data: npy.data};
  }
  const isFloat = npy.dtype[1] === 'f';
  if (isFloat && inp.dtype !== 'float32') throw new Error(`${inp.name}: float data for a ${inp.dtype} input`);
  const data = new Ctor(npy.data.length);
  const [lo, hi] = {int32: [-(2 ** 31), 2 ** 31 - 1], uint8: [0, 255], float32: [-Infinity, Infinity]}[inp.dtype];
  for (let i = 0; i < data.length; i++) {
    const v = Number(npy.data[i]);
    if (v < lo || v > hi) throw new Error(`${inp.name}: value ${npy.data[i]} does not fit ${inp.dtype}`);
    data[i] = v;
  }
  return {dtype: inp.dtype, shape: inp.shape, data};
}
