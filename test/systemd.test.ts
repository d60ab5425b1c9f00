/**
 * The systemd unit of docs/deployment.md as an operator runs it (no systemd runs here, so this test does what it
 * would do): the packed tarball installed with `npm install --global`, the unit's ExecStart command
 * line run from / with nothing but the EnvironmentFile's variables and a PATH, ExecReload's command
 * line with $MAINPID, then KillSignal. The unit and the environment file are deploy/'s, the ones the
 * package ships; the page's unit must be the same text.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile, spawn, type ChildProcess } from 'node:child_process'
import { copyFile, mkdtemp, readFile, realpath, rm } from 'node:fs/promises'
import { readlinkSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'
import { WebSocket } from 'ws'
import { Client } from '../src/index'
import { SETTINGS } from '../proxy/settings'
import { docBlock } from './support/doc-blocks'
import { generateCerts, presented, type TestCerts } from './support/certs'
import { packedTarball } from './support/pack'
import { freePort, PASSWORD, testPostgres } from './support/stack'
import { eventually } from './support/helpers'

const run = promisify(execFile)
const root = fileURLToPath(new URL('..', import.meta.url))
const UNIT = join(root, 'deploy/edgepg-proxy.service')
const ENV_FILE = join(root, 'deploy/edgepg-proxy.env')

let prefix: string
let certs: [TestCerts, TestCerts]
let proxy: ChildProcess | undefined

before(async () => {
  prefix = await mkdtemp(join(tmpdir(), 'edgepg-global-'))
  const tarball = await packedTarball()
  await run('npm', ['install', '--global', '--prefix', prefix, tarball, '--prefer-offline', '--no-audit', '--no-fund', '--loglevel=error'], { timeout: 240_000 })
  certs = [await generateCerts(), await generateCerts()]
})

after(async () => {
  proxy?.kill('SIGKILL')
  await Promise.all([rm(prefix, { recursive: true, force: true }), ...(certs ?? []).map((c) => c.cleanup())])
})

/** `KEY=value` lines (the last of each key): a unit's directives, or an EnvironmentFile's variables (`#` lines are comments). */
function assignments(text: string, line = /^(\w+)=(.*)$/): Map<string, string> {
  const found = new Map<string, string>()
  for (const l of text.split('\n')) {
    const m = line.exec(l.trim())
    if (m) found.set(m[1], m[2])
  }
  return found
}
const directives = (unit: string) => assignments(unit)
const environment = (file: string) => assignments(file, /^(EDGEPG_\w+)=(.*)$/)

test("docs/deployment.md's systemd unit is the one the package ships (deploy/edgepg-proxy.service), and ships it", async () => {
  assert.equal(docBlock('docs/deployment.md', '[Unit]').code, await readFile(UNIT, 'utf8'))
  const pkg = JSON.parse(await readFile(join(root, 'package.json'), 'utf8'))
  assert.ok(pkg.files.includes('deploy'), 'package.json files: deploy')
  const installed = join(prefix, 'lib/node_modules/edgepg/deploy')
  assert.equal(await readFile(join(installed, 'edgepg-proxy.service'), 'utf8'), await readFile(UNIT, 'utf8'))
  assert.equal(await readFile(join(installed, 'edgepg-proxy.env'), 'utf8'), await readFile(ENV_FILE, 'utf8'))
})

test('the environment file names every variable the proxy reads, once, each commented out with its default where it has one', async () => {
  const file = await readFile(ENV_FILE, 'utf8')
  const named = [...file.matchAll(/^#?(EDGEPG_\w+)=/gm)].map((m) => m[1])
  assert.deepEqual([...named].sort(), Object.values(SETTINGS).map((s) => s.env).sort())
  for (const s of Object.values(SETTINGS) as Array<{ env: string; default?: string; kind: string }>) {
    const [, comment, shown] = new RegExp(`^(#?)${s.env}=(.*)$`, 'm').exec(file)!
    if (!comment) continue // (set: the essentials an operator edits)
    const literal = s.default !== undefined && /^[\w.:-]+$/.test(s.default)
    assert.equal(shown, literal ? s.default : s.kind === 'switch' ? 'false' : '', `${s.env}: its default`)
  }
})

test('ExecStart as written runs the global install from / with only the EnvironmentFile: node is the main PID, ExecReload reaches every worker, KillSignal stops it', async () => {
  const unit = directives(await readFile(UNIT, 'utf8'))
  assert.equal(unit.get('EnvironmentFile'), '/etc/edgepg/proxy.env')
  const pg = testPostgres()
  const [port, adminPort] = [await freePort(), await freePort()]
  const [a, b] = certs
  const certFile = join(a.dir, 'fullchain.pem')
  const keyFile = join(a.dir, 'key.pem')
  await copyFile(a.server.certFile, certFile)
  await copyFile(a.server.keyFile, keyFile)
  // The file as written, where this machine differs: its Postgres, free ports, the test's certificates; two workers.
  const env = Object.fromEntries(environment(await readFile(ENV_FILE, 'utf8')))
  assert.deepEqual(Object.keys(env).sort(), ['EDGEPG_ADMIN_LISTEN', 'EDGEPG_CERT', 'EDGEPG_KEY', 'EDGEPG_LISTEN', 'EDGEPG_UPSTREAM'])
  Object.assign(env, { EDGEPG_UPSTREAM: `${pg.host}:${pg.port}`, EDGEPG_LISTEN: `127.0.0.1:${port}`, EDGEPG_ADMIN_LISTEN: `127.0.0.1:${adminPort}`, EDGEPG_CERT: certFile, EDGEPG_KEY: keyFile, EDGEPG_WORKERS: '2' })
  // systemd's PATH for services, with where npm put the command and node first.
  const PATH = [join(prefix, 'bin'), dirname(process.execPath), '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'].join(':')
  const [command, ...args] = unit.get('ExecStart')!.split(/\s+/)
  proxy = spawn(command, args, { cwd: '/', env: { ...env, PATH }, stdio: ['ignore', 'pipe', 'pipe'] })
  let stdout = ''
  let stderr = ''
  proxy.stdout!.setEncoding('utf8').on('data', (c) => (stdout += c))
  proxy.stderr!.setEncoding('utf8').on('data', (c) => (stderr += c))
  const exit = new Promise<number | null>((resolve) => proxy!.once('exit', (code) => resolve(code)))
  const lines = (what: string) => stdout.split('\n').filter((l) => l.includes(what))

  await eventually(() => lines('"listening"').length === 2, 'both workers to listen', 30_000).catch((err) => assert.fail(`${err.message}\n${stdout}\n${stderr}`))
  assert.equal(readlinkSync(`/proc/${proxy.pid}/exe`), await realpath(process.execPath), 'the main PID is node itself, not a wrapper')

  const client = new Client({
    host: 'localhost', port: pg.port, user: 'scram_user', password: PASSWORD, database: pg.database,
    webSocketConstructor: class extends WebSocket { constructor(url: string, p?: string | string[]) { super(url, p, { ca: a.ca.cert + b.ca.cert }) } } as any,
    wsProxy: () => `wss://localhost:${port}/v2`,
  })
  await client.connect()
  assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }])
  const before = await presented(port, a.ca.cert)

  await copyFile(b.server.certFile, certFile)
  await copyFile(b.server.keyFile, keyFile)
  const [reload, ...reloadArgs] = unit.get('ExecReload')!.replace('$MAINPID', String(proxy.pid)).split(/\s+/)
  await run(reload, reloadArgs)
  await eventually(() => lines('certificate reloaded').length === 2, 'each worker to log its reload')
  assert.deepEqual(lines('certificate reloaded').map((l) => JSON.parse(l).worker).sort(), [0, 1])
  for (let i = 0; i < 4; i++) assert.notEqual(await presented(port, b.ca.cert), before, 'new connections get the new certificate')
  assert.deepEqual((await client.query('SELECT 2 AS two')).rows, [{ two: 2 }], 'the running session kept going')
  await client.end()

  assert.equal(unit.get('KillSignal'), 'SIGTERM')
  proxy.kill('SIGTERM')
  const timeout = Number(unit.get('TimeoutStopSec')) * 1000
  assert.equal(await Promise.race([exit, new Promise((r) => setTimeout(() => r('still running'), timeout))]), 0, `stopped within TimeoutStopSec\n${stderr}`)
})
