/**
 * Every code block of the README, CONTRIBUTING.md and docs/ runs, so none can rot: each is claimed by
 * one runner below, which runs it here (against the test Postgres through a real edgepg-proxy) or
 * names the test that takes it from its page and runs it there (test/support/doc-blocks.ts). A
 * block no runner claims fails the first test.
 *
 * The docs' world, and how a block is made to run in this one (nothing else is changed in a block):
 * - the database `app` at db.example.com (or db.internal, db) is a scratch database here, logged in
 *   to as scram_user (`app`'s password `secret`) or postgres (`admin`'s `PASSWORD`); proxies'
 *   upstreams, replicas and listen addresses are this machine's; /etc/edgepg's files are the tests'
 *   certificates and temporary files;
 * - snippets read as if in an app: `pool`, `client`, `env`, `ctx`, `request`, `response`,
 *   `session`, `id`, `handle` and `fs` are what the prelude below gives them, and config.wsProxy
 *   names the test's proxy (as the driver's page says to do first).
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile, spawn } from 'node:child_process'
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'
import pg from 'pg'
import { docBlock, docBlocks, type DocBlock } from './support/doc-blocks'
import { freePort, PASSWORD, testPostgres } from './support/stack'
import { startProxy } from './support/helpers'
import { startPostgres, tlsOnly, type Postgres } from './support/stack'
import { token, tokenFixture } from './support/tokens'
import { generateCerts, type TestCerts } from './support/certs'
import { environmentFile } from '../scripts/docs'
import * as esbuild from 'esbuild'
import { Miniflare } from 'miniflare'
import { EdgeRuntime } from 'edge-runtime'

const run = promisify(execFile)
const root = fileURLToPath(new URL('..', import.meta.url))
const CLI = join(root, 'dist/cli.mjs')
const DB = `edgepg_docs_${process.pid}`
const pgInfo = testPostgres()
const work = mkdtempSync(join(tmpdir(), 'edgepg-docs-'))
/** Snippets run from inside the repository, where `import 'edgepg'` is the package itself. */
const snippets = join(root, '.edgepg', `doc-blocks-${process.pid}`)
let proxy: Awaited<ReturnType<typeof startProxy>>
let certs: TestCerts
/** For the snippets that sign in by token: roles, setup-auth and a passfile (test/support/tokens.ts), and a proxy taking tokens. */
let tokens: Awaited<ReturnType<typeof tokenFixture>>
let tokenProxy: Awaited<ReturnType<typeof startProxy>>
/** For TLS inside the socket: a Postgres serving the tests' `localhost` certificate, and a proxy in front of it. */
let tlsPg: Postgres
let tlsProxy: Awaited<ReturnType<typeof startProxy>>
const superuser = () => new pg.Client({ host: pgInfo.host, port: pgInfo.port, user: 'postgres', password: PASSWORD, database: DB })

/** The tables and function the docs' snippets query. */
const FIXTURE = `
CREATE TABLE users (id int PRIMARY KEY, name text NOT NULL, active boolean NOT NULL DEFAULT true);
INSERT INTO users VALUES (7, 'Ada', true), (8, 'Grace', false);
CREATE TABLE orders (id serial PRIMARY KEY, customer text NOT NULL DEFAULT 'ada', total numeric);
CREATE TABLE t (x int);
CREATE TABLE posts (id serial PRIMARY KEY, title text NOT NULL);
INSERT INTO posts (title) VALUES ('hello'), ('world');
CREATE TABLE items (id int, name text);
CREATE TABLE events (id int, at timestamptz NOT NULL DEFAULT now());
INSERT INTO events (id) SELECT g FROM generate_series(1, 2500) g;
CREATE FUNCTION report(int) RETURNS TABLE (id int, name text) LANGUAGE sql AS 'SELECT id, name FROM users WHERE id = $1';
CREATE TABLE notes (owner text NOT NULL, body text);
GRANT ALL ON ALL TABLES IN SCHEMA public TO scram_user;
GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO scram_user;
`

/** Where a snippet's database and proxy are. */
interface World {
  host: string
  port: number
  database: string
  proxyPort: number
}
const plain = (): World => ({ host: pgInfo.host, port: pgInfo.port, database: DB, proxyPort: proxy.port })
/** A snippet's world: TLS inside the socket (rootCerts) needs a Postgres with a certificate for its name, tokens a proxy taking them. */
const worldOf = (code: string): World =>
  code.includes('rootCerts') ? { host: 'localhost', port: tlsPg.port, database: 'postgres', proxyPort: tlsProxy.port }
  : code.includes('authToken') ? { ...plain(), proxyPort: tokenProxy.port }
  : plain()

/** A block's text in this machine's world (see the head of this file). */
function here(text: string, world = plain()): string {
  const at = `${world.host}:${world.port}`
  const logins: Record<string, string> = { 'app:secret@': `scram_user:${PASSWORD}@`, 'admin:PASSWORD@': `postgres:${PASSWORD}@`, 'app@': 'scram_user@', '': '' }
  return text
    .replace(/postgres:\/\/([^@/\s'"]*@)?(?:db\.example\.com|db\.internal)(?::5432)?\/app/g, (_, login = '') => `postgres://${logins[login] ?? login}${at}/${world.database}`)
    .replace(/(?:127\.0\.0\.1|db\.internal|primary\.db\.internal|replica-\d\.local|db):5432\b/g, at)
    .replaceAll('127.0.0.1:8080', `127.0.0.1:${world.proxyPort}`)
    .replaceAll('wss://pg.example.com/v2', `ws://127.0.0.1:${world.proxyPort}/v2`)
    .replaceAll('/etc/edgepg/fullchain.pem', certs.server.certFile)
    .replaceAll('/etc/edgepg/key.pem', certs.server.keyFile)
    .replaceAll('/etc/edgepg/pgpass', join(work, 'pgpass'))
}

/** How a block runs: here (`run`), or in the test file named (`elsewhere`), which takes it with docBlock(page, marker). */
interface Runner {
  what: string
  claims: (b: DocBlock) => boolean
  run?: (b: DocBlock) => Promise<void>
  elsewhere?: { file: string; marker: string }
}

/** The README's quick start for apps, which test/newcomer.test.ts follows. */
const quickStart = (b: DocBlock) => b.page === 'README.md' && /\/\/ (app|worker)\.mjs|# wrangler\.toml|<!-- index\.html|npm pack|node app\.mjs|--allow-origin http:\/\/127\.0\.0\.1:3000/.test(b.code)
const isCommand = (l: string) => l.trim() && !l.trim().startsWith('#')
/** A block's shell lines, continuations joined. */
const shellLines = (code: string) => code.replace(/\\\n\s*/g, ' ').split('\n').filter(isCommand).map((l) => l.replace(/\s+#.*$/, ''))

/** Runs an `edgepg-proxy …` line (npx -p edgepg or installed) with the built CLI: a subcommand to its end, a proxy until it listens. */
async function proxyLine(line: string) {
  const args: string[] = here(line)
    .replace(/\s+#.*$/, '')
    .replace(/\s*&$/, '')
    .replace(/^(npx -p edgepg )?edgepg-proxy\s*/, '')
    .match(/(?:[^\s"']+|"[^"]*"|'[^']*')+/g) ?? []
  if (args[0] === 'setup-auth' || args[0] === 'token') {
    const { stdout } = await run(process.execPath, [CLI, ...args], { cwd: work, timeout: 30_000 })
    if (args[0] === 'token') assert.match(stdout, /^eyJ[\w-]+\.[\w-]+\.[\w-]+\n$/, `${line}: prints a token`)
    return
  }
  const listen = args.indexOf('--listen')
  const port = await freePort()
  if (listen >= 0) args[listen + 1] = `127.0.0.1:${port}`
  const child = spawn(process.execPath, [CLI, ...args], { cwd: work, env: { ...process.env, EDGEPG_LISTEN: `127.0.0.1:${port}`, EDGEPG_WORKERS: '1' }, stdio: ['ignore', 'pipe', 'pipe'] })
  let said = ''
  child.stdout.on('data', (d) => (said += d))
  child.stderr.on('data', (d) => (said += d))
  const exited = new Promise<number | null>((resolve) => child.on('exit', resolve))
  const deadline = Date.now() + 20_000
  while (!said.includes('"listening"') && child.exitCode === null && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50))
  child.kill('SIGTERM')
  assert.match(said, /"listening":"127\.0\.0\.1:\d+"/, `${line}: the proxy listens; it said: ${said}`)
  assert.equal(await exited, 0, `${line}: exits 0 on SIGTERM; it said: ${said}`)
}

/** What runs a snippet in Node: the names the docs' snippets take as given, the snippet, then their end. */
const prelude = (world: World, code: string, sessionToken: string) => `
import { WebSocket } from 'ws'
import * as fs from 'node:fs'
import * as esbuild from 'esbuild'
import { config, Client, Pool } from 'edgepg'
config.webSocketConstructor = WebSocket
config.wsProxy = '127.0.0.1:${world.proxyPort}/v2'
const connectionString = 'postgres://scram_user:${PASSWORD}@${world.host}:${world.port}/${world.database}'
process.env.DATABASE_URL = connectionString
const waits = []
Object.assign(globalThis, {
  fs,
  esbuild,
  id: 7,
  handle: () => {},
  env: { DATABASE_URL: connectionString },
  ctx: { waitUntil: (p) => waits.push(p) },
  request: { signal: new AbortController().signal, cookies: new Map() },
  response: { cookies: new Map() },
  session: { getToken: async () => '${sessionToken}' },
  pool: new Pool({ connectionString }),
  client: new Client(connectionString),
})
${/\bclient\./.test(code) && !/\bconst client\b/.test(code) ? 'await globalThis.client.connect()' : ''}
await import(process.argv[2])
await Promise.all(waits)
await globalThis.client.end()
await globalThis.pool.end()
process.exit(0) // (what a snippet left open, as an app's request handler would)
`

/** The snippets' directory, as an app's: edgepg installed (a link to this package), and a Worker's source to bundle. */
function snippetsDir() {
  mkdirSync(join(snippets, 'node_modules'), { recursive: true })
  if (!existsSync(join(snippets, 'node_modules/edgepg'))) symlinkSync(root, join(snippets, 'node_modules/edgepg'))
  mkdirSync(join(snippets, 'src'), { recursive: true })
  writeFileSync(join(snippets, 'src/worker.js'), `import pg from 'pg'\nexport default { fetch: () => new Response(typeof pg.Pool) }\n`)
}

async function nodeSnippet(b: DocBlock) {
  snippetsDir()
  const name = `${b.page.replace(/\W/g, '_')}_${b.line}`
  const world = worldOf(b.code)
  writeFileSync(join(snippets, `${name}.run.mjs`), prelude(world, b.code, await token('ada', { seconds: 600 })))
  const file = join(snippets, `${name}.${b.lang === 'ts' ? 'mts' : 'mjs'}`)
  writeFileSync(file, here(b.code, world))
  writeFileSync(join(snippets, 'big.tsv'), '1\tone\n2\ttwo\n')
  writeFileSync(join(snippets, 'pg-ca.pem'), certs.ca.cert)
  await run(process.execPath, ['--import', 'tsx', join(snippets, `${name}.run.mjs`), file], { cwd: snippets, timeout: 60_000 }).catch((err) => {
    throw new Error(`${b.page}:${b.line} failed: ${err.stderr || err.message}`)
  })
}

/** wrangler.toml's settings: its compatibility date, [alias] and [vars] (in this machine's world). */
function wrangler(toml: string) {
  const table = (name: string) => {
    const body = toml.split(`[${name}]\n`)[1]?.split(/^\[/m)[0] ?? ''
    return Object.fromEntries([...body.matchAll(/^(\w+) = "([^"]*)"/gm)].map((m) => [m[1], m[2]]))
  }
  return { date: /^compatibility_date = "([^"]+)"/m.exec(toml)![1], alias: table('alias'), vars: table('vars') }
}

async function workerSnippet(b: DocBlock) {
  snippetsDir()
  const settings = wrangler(here(docBlock('docs/runtimes.md', '# wrangler.toml').code))
  const entry = join(snippets, `worker_${b.line}.mjs`)
  writeFileSync(entry, here(b.code))
  await esbuild.build({ entryPoints: [entry], outfile: join(snippets, `worker_${b.line}.bundle.mjs`), bundle: true, format: 'esm', conditions: ['workerd', 'worker', 'browser'], alias: settings.alias, external: ['cloudflare:workers'], logLevel: 'error' })
  // (DATABASE_URL: the secret `wrangler secret put` would give it.)
  const secrets = { DATABASE_URL: here('postgres://app:secret@db.example.com/app') }
  const mf = new Miniflare({ modules: true, modulesRoot: snippets, scriptPath: join(snippets, `worker_${b.line}.bundle.mjs`), compatibilityDate: settings.date, bindings: { ...settings.vars, ...secrets } })
  try {
    const res = await mf.dispatchFetch('http://app.test/')
    const body = await res.text()
    assert.equal(res.status, 200, body)
    assert.deepEqual(JSON.parse(body).map((r: { title: string }) => r.title), ['world', 'hello'])
  } finally {
    await mf.dispose()
  }
}

async function vercelSnippet(b: DocBlock) {
  snippetsDir()
  const entry = join(snippets, `route_${b.line}.mjs`)
  writeFileSync(entry, here(b.code))
  // Next.js's edge build: one script, the edge conditions; its edge runtime gives process.env.
  const built = await esbuild.build({ entryPoints: [entry], bundle: true, write: false, format: 'iife', globalName: 'route', conditions: ['edge-light', 'worker', 'browser'], logLevel: 'error' })
  const vm = new EdgeRuntime()
  const env = { DATABASE_URL: `postgres://scram_user:${PASSWORD}@${pgInfo.host}:${pgInfo.port}/${DB}`, WS_PROXY: `127.0.0.1:${proxy.port}/v2` }
  vm.evaluate(`globalThis.process = { env: ${JSON.stringify(env)} }`)
  vm.evaluate(built.outputFiles[0].text)
  const text: string = await vm.evaluate(`route.GET().then((res) => res.text())`)
  assert.deepEqual(JSON.parse(text).map((r: { title: string }) => r.title).sort(), ['hello', 'world'])
}

async function denoSnippet(b: DocBlock) {
  snippetsDir()
  const file = join(snippets, `deno_${b.line}.mjs`)
  writeFileSync(file, here(b.code))
  // Until edgepg is on npm, `npm:edgepg` is this package's build (an import map: the line itself is kept).
  writeFileSync(join(snippets, 'deno.json'), JSON.stringify({ imports: { 'npm:edgepg': './node_modules/edgepg/dist/index.mjs' } }))
  const [, flags] = /`deno run ([^`]*)`/.exec(readFileSync(join(root, b.page), 'utf8'))!
  const { stdout } = await run(join(root, 'node_modules/.bin/deno'), ['run', ...here(flags).replace('db.example.com', '127.0.0.1').split(' '), '--no-lock', '--no-prompt', '--config', 'deno.json', file], {
    cwd: snippets,
    env: { ...process.env, DATABASE_URL: `postgres://scram_user:${PASSWORD}@${pgInfo.host}:${pgInfo.port}/${DB}`, WS_PROXY: `127.0.0.1:${proxy.port}/v2` },
    timeout: 60_000,
  })
  assert.match(stdout, /now: \d{4}-\d\d-\d\dT/)
}

async function nginxSnippet(b: DocBlock) {
  const dir = mkdtempSync(join(work, 'nginx-'))
  const port = await freePort()
  // The block is the server's location; around it, what an nginx.conf of one's own has.
  writeFileSync(join(dir, 'nginx.conf'), `daemon off;\npid ${dir}/nginx.pid;\nerror_log ${dir}/error.log;\nevents {}\nhttp {\n  access_log off;\n  client_body_temp_path ${dir};\n  proxy_temp_path ${dir};\n  server {\n    listen 127.0.0.1:${port};\n${here(b.code)}  }\n}\n`)
  const nginx = spawn('/usr/sbin/nginx', ['-p', dir, '-c', join(dir, 'nginx.conf')], { stdio: ['ignore', 'pipe', 'pipe'] })
  let said = ''
  nginx.stderr.on('data', (d) => (said += d))
  try {
    const { Client } = await import('edgepg' as string)
    const { WebSocket } = await import('ws')
    let client: InstanceType<typeof Client> | undefined
    for (let i = 0; i < 100 && !client; i++) {
      const c = new Client({ connectionString: `postgres://scram_user:${PASSWORD}@${pgInfo.host}:${pgInfo.port}/${DB}`, webSocketConstructor: WebSocket, wsProxy: `127.0.0.1:${port}/v2` })
      c.on('error', () => {})
      client = await c.connect().then(() => c, () => (c.end().catch(() => {}), new Promise((r) => setTimeout(r, 50)).then(() => undefined)))
    }
    assert.ok(client, `a Client through nginx; nginx said: ${said}`)
    assert.deepEqual((await client.query('SELECT $1::text AS through', ['nginx'])).rows, [{ through: 'nginx' }])
    await client.end()
  } finally {
    nginx.kill('SIGTERM')
    await new Promise((r) => nginx.once('exit', r))
  }
}

const RUNNERS: Runner[] = [
  { what: 'a figure, not code', claims: (b) => b.lang === 'text' },
  {
    what: "the set-up, as .ci/run runs it on every CI",
    claims: (b) => b.page === 'README.md' && b.code.includes('npm test'),
    run: async (b) => {
      const ci = readFileSync(join(root, '.ci/run'), 'utf8')
      for (const line of shellLines(b.code).map((l) => l.replace(/\s+#.*$/, ''))) {
        if (line === 'npm start') continue // (test/demo.test.ts runs what npm start runs)
        assert.ok(ci.includes(line.replace('npm install', 'npm ci')), `.ci/run runs ${line}`)
      }
    },
  },
  {
    what: "the quick start's blocks, run from the packed tarball in a fresh project",
    claims: quickStart,
    elsewhere: { file: 'test/newcomer.test.ts', marker: "docBlock('README.md'" },
  },
  {
    what: 'edgepg-proxy command lines (a proxy until it listens, setup-auth, token), and the shell lines beside them',
    claims: (b) => b.lang === 'sh' && !quickStart(b) && shellLines(b.code).every((l) => /^(npx -p edgepg )?edgepg-proxy\b|^head -c 32 \/dev\/urandom > jwt\.key$/.test(l)),
    run: async (b) => {
      writeFileSync(join(work, 'pgpass'), `*:*:*:scram_user:${PASSWORD}\n`, { mode: 0o600 })
      for (const line of shellLines(b.code)) {
        if (line.startsWith('head -c')) await run('sh', ['-c', line], { cwd: work })
        else await proxyLine(line)
      }
    },
  },
  {
    what: "the environment file's excerpt: lines of the shipped file (test/systemd.test.ts runs it)",
    claims: (b) => b.page === 'docs/deployment.md' && b.code.startsWith('# Essentials\n'),
    run: async (b) => {
      const shipped = environmentFile().split('\n')
      for (const line of b.code.split('\n').filter((l) => l && l !== '# …')) assert.ok(shipped.includes(line), `deploy/edgepg-proxy.env has ${line}`)
    },
  },
  {
    what: 'SQL, as a superuser in the docs database',
    claims: (b) => b.lang === 'sql',
    run: async (b) => {
      const db = superuser()
      await db.connect()
      try {
        await db.query(`DROP ROLE IF EXISTS web_user`)
        await db.query(b.code)
      } finally {
        await db.query(`DROP POLICY IF EXISTS own_notes ON notes; REVOKE ALL ON notes FROM web_user; DROP ROLE IF EXISTS web_user`).catch(() => {})
        await db.end()
      }
    },
  },
  {
    what: 'a snippet for Node (or any runtime), run in Node with the prelude',
    claims: (b) => (b.lang === 'js' || b.lang === 'ts') && !/export default|from 'npm:|@vercel|cloudflare:|generated\/client/.test(b.code) && b.page !== 'README.md',
    run: nodeSnippet,
  },
  {
    what: 'wrangler.toml: the Workers below run with its settings',
    claims: (b) => b.lang === 'toml' && b.page === 'docs/runtimes.md',
    run: async (b) => assert.ok(wrangler(b.code).vars.WS_PROXY, 'it names the proxy'),
  },
  {
    what: 'a Worker, bundled as wrangler does with the wrangler.toml above and run in workerd',
    claims: (b) => b.page === 'docs/runtimes.md' && b.lang === 'js' && /export default \{|cloudflare:workers/.test(b.code),
    run: workerSnippet,
  },
  { what: 'a Next.js route for Vercel Edge, run in Vercel\'s edge-runtime', claims: (b) => b.code.includes('@vercel/functions'), run: vercelSnippet },
  { what: 'a Deno program, run by Deno', claims: (b) => b.code.includes("from 'npm:edgepg'"), run: denoSnippet },
  { what: 'Prisma in a Worker', claims: (b) => b.code.includes('generated/client'), elsewhere: { file: 'test/prisma.test.ts', marker: "docBlock('docs/driver.md', 'PrismaPg')" } },
  { what: "Neon's name for edgepg, in a fresh project", claims: (b) => b.lang === 'json' && b.page === 'docs/neon.md', elsewhere: { file: 'test/neon-alias.test.ts', marker: "docBlock('docs/neon.md', 'overrides')" } },
  { what: 'HAProxy in front of two proxies', claims: (b) => b.lang === 'haproxy', elsewhere: { file: 'test/haproxy.test.ts', marker: "docBlock('docs/deployment.md', 'frontend edge')" } },
  { what: "the container's build and run (no container engine here: its stages run outside one)", claims: (b) => b.code.startsWith('docker build'), elsewhere: { file: 'test/docker.test.ts', marker: "docBlock('docs/deployment.md', 'docker run')" } },
  { what: "nginx (Debian's) in front of the proxy: a Client through it", claims: (b) => b.lang === 'nginx', run: nginxSnippet },
  { what: 'the systemd unit', claims: (b) => b.lang === 'ini', elsewhere: { file: 'test/systemd.test.ts', marker: "'docs/deployment.md', '[Unit]'" } },
]

before(async () => {
  certs = await generateCerts()
  proxy = await startProxy()
  tlsPg = await startPostgres(tlsOnly(18, certs.server))
  tlsProxy = await startProxy({ upstream: `127.0.0.1:${tlsPg.port}` })
  const admin = new pg.Client({ host: pgInfo.host, port: pgInfo.port, user: 'postgres', password: PASSWORD, database: 'postgres' })
  await admin.connect()
  await admin.query(`CREATE DATABASE ${DB} OWNER scram_user`)
  await admin.end()
  const db = superuser()
  await db.connect()
  await db.query(FIXTURE)
  await db.end()
  tokens = await tokenFixture(`docs_notes_${process.pid}`, { ...pgInfo, database: DB })
  tokenProxy = await startProxy({ tokens: tokens.options })
})

after(async () => {
  await proxy?.close()
  await tokenProxy?.close()
  await tlsProxy?.close()
  await tlsPg?.stop()
  await tokens?.teardown()
  await certs?.cleanup()
  const admin = new pg.Client({ host: pgInfo.host, port: pgInfo.port, user: 'postgres', password: PASSWORD, database: 'postgres' })
  await admin.connect()
  await admin.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`)
  await admin.end()
  rmSync(work, { recursive: true, force: true })
  rmSync(snippets, { recursive: true, force: true })
})

const blocks = docBlocks()
const runnerOf = (b: DocBlock) => RUNNERS.filter((r) => r.claims(b))

test('every code block of the README and docs/ has one runner', () => {
  const unclaimed = blocks.filter((b) => runnerOf(b).length !== 1).map((b) => `${b.page}:${b.line} (${b.lang || 'no language'}, ${runnerOf(b).length} runners): ${b.code.split('\n')[0]}`)
  assert.deepEqual(unclaimed, [])
  for (const { elsewhere } of RUNNERS) {
    if (elsewhere) assert.ok(readFileSync(join(root, elsewhere.file), 'utf8').includes(elsewhere.marker), `${elsewhere.file} takes its block from the page (${elsewhere.marker})`)
  }
})

for (const b of blocks) {
  const [runner] = runnerOf(b)
  if (!runner?.run) continue
  test(`${b.page}:${b.line}: ${b.code.split('\n')[0].slice(0, 80)} (${runner.what})`, () => runner.run!(b))
}
