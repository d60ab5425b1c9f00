/**
 * A newcomer following the README's "Quick start: your app" and nothing else: its lines, run as
 * written in a fresh project, on the packed tarball (test/support/pack.ts: `npm pack` on a clean
 * clone, as the README's first line does). Where the README names this machine's ports and its
 * Postgres's password, the test puts its own (PORTS below); it adds nothing else but what stands in
 * for the user: a static file server for the page, and esbuild with wrangler's settings for the Worker.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile, spawn, type ChildProcess } from 'node:child_process'
import { createServer, type Server } from 'node:http'
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { extname, join } from 'node:path'
import { promisify } from 'node:util'
import * as esbuild from 'esbuild'
import { Miniflare } from 'miniflare'
import { packedTarball } from './support/pack'
import { docBlock } from './support/doc-blocks'
import { freePort, PASSWORD } from './support/stack'
import { testPostgres, within, eventually } from './support/helpers'
import { launchChromium } from './support/chromium'

const run = promisify(execFile)
/** The quick start's block whose first line names its file (`// app.mjs`, `# wrangler.toml`, `<!-- index.html -->`). */
const file = (firstLine: string) => docBlock('README.md', firstLine).code
/** The quick start's shell line containing `text`. */
const line = (text: string) => docBlock('README.md', text).code.split('\n').find((l) => l.includes(text))!.replace(/\s+#.*$/, '')

const work = mkdtempSync(join(tmpdir(), 'edgepg-newcomer-'))
const app = join(work, 'my-app')
let proxy: ChildProcess | undefined
let pages: Server | undefined
let proxyPort: number
let pagePort: number

/** This machine's own ports and password where the README has its example's. */
function ours(text: string) {
  const pg = testPostgres()
  return text
    .replaceAll('127.0.0.1:8080', `127.0.0.1:${proxyPort}`)
    .replaceAll('127.0.0.1:3000', `127.0.0.1:${pagePort}`)
    .replaceAll('postgres:secret@127.0.0.1:5432', `postgres:${PASSWORD}@${pg.host}:${pg.port}`)
    .replaceAll('127.0.0.1:5432', `${pg.host}:${pg.port}`)
}

const sh = (command: string, env: Record<string, string> = {}) => run('sh', ['-c', command], { cwd: app, env: { ...process.env, npm_config_prefer_offline: 'true', npm_config_audit: 'false', npm_config_fund: 'false', ...env }, timeout: 240_000 })

before(async () => {
  proxyPort = await freePort()
  pagePort = await freePort()
  mkdirSync(app)
  await sh('npm init -y')
  // Step 1: the install line, from the app (`cd ../my-app` is where the test already is), the tarball where the pack put it.
  const install = line('npm install ').replace(/^cd \S+ && /, '').replace(/\S+edgepg-0\.1\.0\.tgz/, await packedTarball())
  await sh(install)
  // Step 2: the proxy, as the README starts it (it listens where EDGEPG_LISTEN says: the test's free port, not 8080).
  proxy = spawn('sh', ['-c', `exec ${ours(line('edgepg-proxy --upstream 127.0.0.1:5432'))}`], { cwd: app, env: { ...process.env, EDGEPG_LISTEN: `127.0.0.1:${proxyPort}` }, stdio: ['ignore', 'pipe', 'pipe'], detached: true })
  let said = ''
  proxy.stdout!.on('data', (d) => (said += d))
  proxy.stderr!.on('data', (d) => (said += d))
  await eventually(() => said.includes('"listening"'), `the README's proxy to listen (it said: ${said})`, 60_000)
})

after(async () => {
  // npx and the proxy under it: the whole group.
  if (proxy?.pid) process.kill(-proxy.pid, 'SIGTERM')
  pages?.close()
  rmSync(work, { recursive: true, force: true })
})

test("the README's Node script prints the row its comment says", async () => {
  const code = file('// app.mjs')
  writeFileSync(join(app, 'app.mjs'), ours(code))
  const { stdout } = await sh(ours(line('node app.mjs')))
  const expected = /console\.log\(rows\) \/\/ (.*)$/m.exec(code)![1]
  assert.equal(stdout.trim(), expected)
})

test("the README's Worker, with its wrangler.toml's settings, answers from Postgres in workerd", async () => {
  writeFileSync(join(app, 'worker.mjs'), ours(file('// worker.mjs')))
  const toml = ours(file('# wrangler.toml'))
  const setting = (key: string, text = toml) => new RegExp(`^${key} = "([^"]*)"`, 'm').exec(text)?.[1]
  const vars = Object.fromEntries(['WS_PROXY', 'DATABASE_URL'].map((k) => [k, setting(k, toml.slice(toml.indexOf('[vars]')))!]))
  // wrangler's bundling: esbuild, ES modules, the workerd conditions, from the app's node_modules.
  await esbuild.build({ entryPoints: [join(app, setting('main')!)], outfile: join(app, 'dist/worker.mjs'), bundle: true, format: 'esm', conditions: ['workerd', 'worker', 'browser'], logLevel: 'error' })
  const mf = new Miniflare({ modules: true, modulesRoot: app, scriptPath: join(app, 'dist/worker.mjs'), compatibilityDate: setting('compatibility_date'), bindings: vars })
  try {
    const res = await within(30_000, 'the Worker to answer', mf.dispatchFetch('http://my-app.test/'))
    const body = await res.text()
    assert.equal(res.status, 200, body)
    const rows = JSON.parse(body)
    assert.equal(rows.length, 1)
    assert.ok(Math.abs(Date.parse(rows[0].now) - Date.now()) < 60_000, `now() from Postgres: ${body}`)
  } finally {
    await mf.dispose()
  }
})

test("the README's browser page, served from the app's folder, shows Postgres's version", async () => {
  writeFileSync(join(app, 'index.html'), ours(file('<!-- index.html')))
  const types: Record<string, string> = { '.html': 'text/html', '.mjs': 'text/javascript', '.js': 'text/javascript' }
  // Stands in for `python3 -m http.server 3000`: the folder's files, as they are.
  pages = createServer((req, res) => {
    const path = join(app, decodeURIComponent(new URL(req.url!, 'http://x').pathname).replace(/\/$/, '/index.html'))
    try {
      const body = readFileSync(path)
      res.writeHead(200, { 'content-type': types[extname(path)] ?? 'application/octet-stream' }).end(body)
    } catch {
      res.writeHead(404).end()
    }
  })
  await new Promise<void>((resolve) => pages!.listen(pagePort, '127.0.0.1', resolve))
  const browser = await within(60_000, 'Chromium to start', launchChromium())
  try {
    const page = await browser.newPage()
    const errors: string[] = []
    page.on('pageerror', (e) => errors.push(e.message))
    await page.goto(`http://127.0.0.1:${pagePort}/`)
    await page.waitForFunction(() => document.getElementById('out')?.textContent, undefined, { timeout: 30_000 }).catch(() => assert.fail(`the page showed nothing; its errors: ${errors.join('; ')}`))
    assert.match((await page.textContent('#out'))!, /^PostgreSQL \d+/)
  } finally {
    await browser.close()
  }
})
