// Drives a served page in headless Chromium and calls its `window.tte` API.
//
//   node driver.mjs URL [--chromium /usr/bin/chromium] [--webgpu swiftshader|off] [--screenshot out.png]
//
// --webgpu: whether the browser has WebGPU (which LiteRT.js's WebGPU accelerator needs).
//   swiftshader (default): WebGPU on SwiftShader, Chromium's software Vulkan, so any machine (CI)
//     has an adapter: --enable-unsafe-webgpu --use-webgpu-adapter=swiftshader. Headless Chromium
//     has navigator.gpu but no adapter without them.
//   off: without those flags: requestAdapter() gives no adapter and the page's 'auto' runs on WASM.
//
// Reads one JSON request a line on stdin, {"id": 1, "call": "run", "args": {...}}, calls
// window.tte[call](args) in the page, and writes {"id": 1, "ok": true, "result": ...} (or
// "ok": false with "error") a line on stdout. A request with "page": "classify.html" (a URL
// relative to URL, or absolute) goes to that page, opened in a tab of the same browser on
// first use. One browser serves every request; it closes when stdin ends. Page console
// output goes to stderr.
import {createInterface} from 'node:readline';
import {chromium} from 'playwright-core';

function parseArgs(argv) {
  const opts = {url: null, chromium: process.env.CHROMIUM || '/usr/bin/chromium', screenshot: null, webgpu: 'swiftshader'};
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--chromium') opts.chromium = argv[++i];
    else if (argv[i] === '--webgpu') opts.webgpu = argv[++i];
    else if (argv[i] === '--screenshot') opts.screenshot = argv[++i];
    else if (!opts.url) opts.url = argv[i];
    else throw new Error(`unexpected argument ${argv[i]}`);
  }
  if (!opts.url) {
    throw new Error('usage: node driver.mjs URL [--chromium PATH] [--webgpu swiftshader|off] [--screenshot FILE]');
  }
  if (!(opts.webgpu in WEBGPU_FLAGS)) throw new Error(`--webgpu ${opts.webgpu}: one of ${Object.keys(WEBGPU_FLAGS).join(', ')}`);
  return opts;
}

const WEBGPU_FLAGS = {
  swiftshader: ['--disable-gpu', '--enable-unsafe-webgpu', '--use-webgpu-adapter=swiftshader'],
  off: ['--disable-gpu'],
};

const write = (obj) => new Promise((resolve) => process.stdout.write(JSON.stringify(obj) + '\n', resolve));

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const browser = await chromium.launch({
    executablePath: opts.chromium,
    headless: true,
    // playwright-core gives the browser a fresh temporary --user-data-dir of its own
    args: ['--no-sandbox', ...WEBGPU_FLAGS[opts.webgpu], '--disable-quic', '--no-first-run',
           '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  try {
    const context = await browser.newContext();
    const pages = new Map();  // absolute URL -> page
    const open = async (url) => {
      if (!pages.has(url)) {
        const page = await context.newPage();
        const tag = new URL(url).pathname;
        page.on('console', (msg) => process.stderr.write(`[${tag} ${msg.type()}] ${msg.text()}\n`));
        page.on('pageerror', (err) => process.stderr.write(`[${tag} error] ${err.message}\n`));
        await page.goto(url);
        await page.waitForFunction(() => window.tteReady === true, null, {timeout: 60000});
        pages.set(url, page);
      }
      return pages.get(url);
    };
    const first = await open(opts.url);
    await write({ready: true, userAgent: await first.evaluate(() => navigator.userAgent), webgpu: opts.webgpu});
    const lines = createInterface({input: process.stdin, crlfDelay: Infinity});
    for await (const line of lines) {
      if (!line.trim()) continue;
      let request = {};
      try {
        request = JSON.parse(line);
        const page = request.page ? await open(new URL(request.page, opts.url).href) : first;
        const result = await page.evaluate(
            async ([call, args]) => {
              if (typeof window.tte?.[call] !== 'function') throw new Error(`the page has no tte.${call}()`);
              return await window.tte[call](args);
            },
            [request.call, request.args ?? {}]);
        await write({id: request.id, ok: true, result});
      } catch (e) {
        const message = String(e?.message ?? e).replace(/^page\.evaluate: (Error: )?/, '').split('\n')[0];
        await write({id: request.id, ok: false, error: message});
      }
    }
    if (opts.screenshot) await [...pages.values()].at(-1).screenshot({path: opts.screenshot, fullPage: true});
  } finally {
    await browser.close();
  }
}

main().catch((e) => {
  process.stderr.write(`driver: ${e?.message ?? e}\n`);
  process.exit(1);
});
