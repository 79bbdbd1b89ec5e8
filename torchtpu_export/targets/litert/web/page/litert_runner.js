// Loads .tflite models with LiteRT.js and runs them on typed arrays, on its WebGPU accelerator
// where the browser has WebGPU, else on its CPU (WASM, XNNPack) path.
// Shared by index.html (any model), classify.html (the image demo) and driver.mjs (tests).
import {getWebGpuDevice, loadAndCompile, loadLiteRt, supportsFeature, Tensor} from '@litertjs/core';

// Served by `torchtpu-export serve-web` out of node_modules: never a CDN.
export const WASM_DIR = '/vendor/@litertjs/core/wasm/';

// The dtypes a LiteRT.js Tensor can hold (its DATATYPES table in @litertjs/core 2.5).
export const ARRAYS = {float32: Float32Array, int32: Int32Array, uint8: Uint8Array};

// 'auto': WebGPU where the browser gives an adapter and the model compiles for it, else WASM.
// 'webgpu' and 'wasm' insist: 'webgpu' fails with the reason rather than falling back.
export const ACCELERATORS = ['auto', 'webgpu', 'wasm'];

let liteRtLoading = null;
// accelerator: the page's choice (?accelerator=, else serve-web's --accelerator from /config.json,
// else 'auto'); build: the LiteRT.js wasm build loaded ('jspi', 'threaded' or 'single', see initLiteRt);
// threads: whether that build runs XNNPack multi-threaded; noJspi: why the build is not the JSPI one;
// webgpu: {available, adapter, reason}.
export const runtime = {accelerator: 'auto', build: null, threads: false, noJspi: null, webgpu: null};

/** An accelerator choice checked against ACCELERATORS (where: what named it, for the error). */
export function checkAccelerator(value, where = 'accelerator') {
  if (!ACCELERATORS.includes(value)) throw new Error(`${where}=${value}: choose one of ${ACCELERATORS.join(', ')}`);
  return value;
}

// LiteRT.js's wasm logs through the console functions it finds when it loads (which ops its WebGPU
// delegate rejects among them): they are wrapped first so a compile can read what it logged.
const wasmLog = {lines: null};
function tapConsole() {
  for (const level of ['error', 'log']) {
    const original = console[level];
    console[level] = function (...args) {
      wasmLog.lines?.push(args.map(String).join(' '));
      return original.apply(this, args);
    };
  }
}

/**
 * Whether the browser gives a WebGPU adapter: {available, adapter, reason}. `adapter` names the GPU
 * (vendor and architecture, e.g. "google swiftshader"); `reason` says why WebGPU is unavailable.
 */
async function probeWebGpu() {
  if (!globalThis.isSecureContext) {
    return {available: false, reason: 'the page is not a secure context (WebGPU needs https or localhost)'};
  }
  if (!globalThis.navigator?.gpu) return {available: false, reason: 'the browser has no WebGPU (no navigator.gpu)'};
  let adapter = null;
  try {
    adapter = await navigator.gpu.requestAdapter({powerPreference: 'high-performance'});
  } catch (e) {
    return {available: false, reason: `requestAdapter() failed: ${e?.message ?? e}`};
  }
  if (!adapter) {
    return {available: false, reason: 'no adapter (requestAdapter() found no GPU this browser lets WebGPU use)'};
  }
  const info = adapter.info ?? {};
  const name = [info.vendor, info.architecture, info.description].filter(Boolean).join(' ') || 'unnamed adapter';
  return {available: true, adapter: name, reason: null};
}

async function configuredAccelerator() {
  const query = new URLSearchParams(globalThis.location?.search ?? '').get('accelerator');  // ?accelerator=wasm
  if (query !== null) return checkAccelerator(query, '?accelerator');
  try {
    const response = await fetch('/config.json');  // serve-web --accelerator
    if (response.ok) return checkAccelerator((await response.json()).accelerator ?? 'auto', 'serve-web --accelerator');
  } catch (e) {
    if (!(e instanceof TypeError)) throw e;  // a page served without /config.json
  }
  return 'auto';
}

/**
 * Loads the LiteRT.js wasm module once per page. Where the page may run models on WebGPU (its
 * accelerator is not 'wasm' and the browser gives an adapter): the JSPI build where the browser has
 * JSPI (only it lets LiteRT.js split a model between WebGPU and WASM, running on the CPU the ops its
 * WebGPU delegate does not take), else the single-threaded one. Never the multi-threaded build
 * there: in LiteRT.js 2.5.3 freeing a WebGPU model while a model compiled for its multi-threaded
 * WASM is alive hangs the page, and LiteRT.js frees one itself when it falls back. A page that runs
 * WASM only gets the multi-threaded build where it is cross-origin isolated (serve-web sends the
 * COOP/COEP headers that SharedArrayBuffer needs) and the browser has wasm threads and relaxed
 * SIMD, else the single-threaded one. ?threads=0 and ?jspi=0 in the URL rule out those builds.
 * LiteRT.js opens its WebGPU device as it loads.
 */
export function initLiteRt(wasmDir = WASM_DIR) {
  liteRtLoading ??= (async () => {
    const query = new URLSearchParams(globalThis.location?.search ?? '');
    runtime.accelerator = await configuredAccelerator();
    let gpu = await probeWebGpu();
    const mayUseGpu = runtime.accelerator !== 'wasm' && gpu.available;
    runtime.noJspi = !(await supportsFeature('jspi') && await supportsFeature('relaxedSimd'))
      ? 'which this browser cannot run (it lacks JSPI or relaxed SIMD)'
      : query.get('jspi') === '0' ? 'which ?jspi=0 turned off'
      : runtime.accelerator === 'wasm' ? 'which a page set to the wasm accelerator does not load'
      : !gpu.available ? 'which a page without WebGPU does not load' : null;
    if (!runtime.noJspi) {
      runtime.build = 'jspi';
    } else if (!mayUseGpu && query.get('threads') !== '0' && globalThis.crossOriginIsolated &&
               await supportsFeature('relaxedSimd') && await supportsFeature('threads')) {
      runtime.build = 'threaded';
    } else {
      runtime.build = 'single';
    }
    runtime.threads = runtime.build === 'threaded';
    if (gpu.available && runtime.threads) {  // a page loaded for WASM (see above)
      gpu = {available: false, adapter: gpu.adapter,
             reason: "a page set to wasm loads LiteRT.js's multi-threaded WASM, beside which LiteRT.js 2.5.3 " +
                     'can hang freeing a WebGPU model (open it with ?accelerator=auto or webgpu)'};
    }
    tapConsole();
    const liteRt = await loadLiteRt(wasmDir, {threads: runtime.threads, jspi: runtime.build === 'jspi'});
    if (gpu.available && !getWebGpuDevice()) {  // LiteRT.js opens its own device on the adapter
      gpu = {available: false, adapter: gpu.adapter,
             reason: `LiteRT.js could not open a WebGPU device on ${gpu.adapter} (the console says why)`};
    }
    runtime.webgpu = gpu;
    return liteRt;
  })();
  return liteRtLoading;
}

let compiling = Promise.resolve();  // one compile at a time, so each reads only its own log lines

/** loadAndCompile for one accelerator; returns {model, log: the lines LiteRT.js's wasm logged meanwhile}. */
function compile(bytes, accelerator) {
  const run = compiling.then(async () => {
    wasmLog.lines = [];
    try {
      const model = await loadAndCompile(bytes, {accelerator});
      return {model, log: wasmLog.lines};
    } finally {
      wasmLog.lines = null;
    }
  });
  compiling = run.catch(() => {});
  return run;
}

/**
 * The ops LiteRT.js's WebGPU delegate left to the CPU, from what it logged: "Following operations
 * are not supported by GPU delegate:", a line an op ("RESHAPE: Tensor dimensions must be less than
 * 5. node/12"), then "N operations will run on the GPU, and the remaining M operations will run on
 * the CPU." Returns {ops: those lines, summary: one line, op kinds and reasons with counts, gpu, cpu}.
 */
function cpuOpsFrom(log) {
  const start = log.findIndex((l) => /not supported by GPU delegate/.test(l));
  const found = {ops: [], summary: '', gpu: null, cpu: null};
  if (start < 0) return found;
  for (const line of log.slice(start + 1)) {
    const counts = /(\d+) operations will run on the GPU, and the remaining (\d+)/.exec(line);
    if (counts) {
      [found.gpu, found.cpu] = [Number(counts[1]), Number(counts[2])];
      break;
    }
    if (line.trim()) found.ops.push(line.trim());
  }
  const kinds = new Map();
  for (const op of found.ops) {
    const kind = op.replace(/\.\s+\S+\/\d+\s*$/, '');  // the node's name and index after the reason
    kinds.set(kind, (kinds.get(kind) ?? 0) + 1);
  }
  found.summary = Array.from(kinds, ([kind, n]) => (n > 1 ? `${n} x ${kind}` : kind)).join('; ');
  return found;
}

function wasmBuild() {
  return {jspi: 'single-threaded, JSPI build', threaded: 'multi-threaded', single: 'single-threaded'}[runtime.build];
}

/**
 * Lines for the page: {where: the accelerator a model runs on ("WebGPU on google swiftshader",
 * "WASM (multi-threaded)"), text: that and why (the ops left to WASM, or why not WebGPU)}.
 */
export function describeAccelerator(acc) {
  if (acc.used === 'webgpu') {
    if (acc.fullyAccelerated) return {where: `WebGPU on ${acc.adapter}`, text: `WebGPU on ${acc.adapter}`};
    const n = acc.cpuOpCount ?? acc.cpuOps.length;
    const of = acc.gpuOpCount !== null ? ` of ${acc.gpuOpCount + n}` : '';
    const where = `WebGPU on ${acc.adapter}, with ${n || 'some'}${of} op${n === 1 && !of ? '' : 's'} on WASM ` +
                  `(${wasmBuild()})`;
    return {where, text: `${where}; its WebGPU delegate does not run ${acc.cpuOpsSummary || 'every op'}`};
  }
  const where = `WASM (${wasmBuild()})`;
  return {where, text: where + (acc.note ? `; ${acc.note}` : '')};
}

function compileError(url, e) {
  const msg = String(e?.message ?? e);
  if (/Element type .* is not supported/.test(msg)) {
    return new Error(`${url}: ${msg} LiteRT.js tensors are ${Object.keys(ARRAYS).join(', ')}; ` +
                     'reconvert for the web with tte.convert(..., io_dtypes="web").');
  }
  return new Error(`${url}: LiteRT.js could not load the model: ${msg}`);
}

function detailsOf(d) {
  return {name: d.name, dtype: d.dtype, shape: Array.from(d.shape)};
}

/**
 * Fetches and compiles a model for an accelerator ('auto', 'webgpu', 'wasm'; default: the page's);
 * returns {model, signatures, bytes, timings, accelerator} where accelerator is {requested,
 * used: 'webgpu' | 'wasm', fullyAccelerated, cpuOps, cpuOpsSummary, cpuOpCount, gpuOpCount, adapter,
 * build, note, where, text}: `note` says why 'auto' fell back to WASM, `cpuOps` the ops of a WebGPU
 * model that run on WASM, `where` the accelerator in words, `text` that and the why in a line.
 */
export async function loadModel(url, accelerator = null) {
  await initLiteRt();
  const requested = checkAccelerator(accelerator ?? runtime.accelerator);
  const gpu = runtime.webgpu;
  if (requested === 'webgpu' && !gpu.available) {
    throw new Error(`${url}: WebGPU was asked for (accelerator=webgpu) and is unavailable: ${gpu.reason}`);
  }
  const t0 = performance.now();
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  const bytes = new Uint8Array(await response.arrayBuffer());
  const t1 = performance.now();
  let compiled = null;
  let note = null;
  if (requested !== 'wasm' && gpu.available) {
    try {
      compiled = await compile(bytes, 'webgpu');
    } catch (e) {
      if (requested === 'webgpu') throw compileError(url, e);
      note = `WebGPU could not compile the model: ${e?.message ?? e}`;
    }
    // A model its WebGPU delegate cannot take whole runs split, the rest on WASM, in the JSPI build
    // only. Without JSPI in the browser LiteRT.js recompiles it for WASM itself; with JSPI in the
    // browser but another build loaded, LiteRT.js splits it anyway and a run can fail ("ReferenceError:
    // Asyncify is not defined", seen with the Llama decode step): recompiled for WASM here.
    const onGpu = compiled?.model.options.accelerator === 'webgpu';
    if (compiled && !(onGpu && (compiled.model.isFullyAccelerated || runtime.build === 'jspi'))) {
      const ops = cpuOpsFrom(compiled.log);
      note = `WebGPU cannot run the whole model (${ops.summary || 'some ops'}) and splitting it between WebGPU ` +
             `and WASM needs LiteRT.js's JSPI build, ${runtime.noJspi}`;
      if (onGpu || requested === 'webgpu') {  // else it is LiteRT.js's own WASM recompile: kept
        compiled.model.delete();
        compiled = null;
      }
      if (requested === 'webgpu') throw new Error(`${url}: WebGPU was asked for (accelerator=webgpu) but ${note}`);
    }
  } else if (requested === 'auto') {
    note = `WebGPU unavailable: ${gpu.reason}`;
  }
  try {
    compiled ??= await compile(bytes, 'wasm');
  } catch (e) {
    throw compileError(url, e);
  }
  const t2 = performance.now();
  const {model, log} = compiled;
  const used = model.options.accelerator;
  const ops = used === 'webgpu' && !model.isFullyAccelerated ? cpuOpsFrom(log) : null;
  const acc = {requested, used, fullyAccelerated: used === 'wasm' || model.isFullyAccelerated,
               cpuOps: ops?.ops ?? [], cpuOpsSummary: ops?.summary ?? '', cpuOpCount: ops?.cpu ?? null,
               gpuOpCount: ops?.gpu ?? null,
               adapter: used === 'webgpu' ? gpu.adapter : null, build: runtime.build, note};
  Object.assign(acc, describeAccelerator(acc));
  const signatures = {};
  for (const [key, runner] of Object.entries(model.signatures)) {
    signatures[key] = {inputs: runner.getInputDetails().map(detailsOf),
                       outputs: runner.getOutputDetails().map(detailsOf)};
  }
  return {model, url, bytes: bytes.length, signatures, defaultSignature: model.key, threads: runtime.threads,
          accelerator: acc, timings: {fetchMs: t1 - t0, compileMs: t2 - t1}};
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
