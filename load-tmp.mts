import { readFileSync } from 'node:fs'
import { WebSocket } from 'ws'
import { Client, neonConfig } from './src/index'
const { port } = JSON.parse(readFileSync('/work/compat/run/pg.json','utf8'))
const PROXY = Number(process.env.PROXY ?? 8899)
const admin = new (await import('pg')).default.Client({ host: '127.0.0.1', port, user: 'kysely', password: 'kysely', database: 'kysely_test' })
await admin.connect()
await admin.query('CREATE TABLE IF NOT EXISTS items (id int PRIMARY KEY, v text)')
await admin.query("INSERT INTO items SELECT i, md5(i::text) FROM generate_series(1, 1000) i ON CONFLICT DO NOTHING")
const clients = Array.from({ length: 64 }, () => new Client({ host: '127.0.0.1', port, user: 'kysely', password: 'kysely', database: 'kysely_test', webSocketConstructor: WebSocket, wsProxy: () => `ws://127.0.0.1:${PROXY}/v2` } as any))
await Promise.all(clients.map((c) => c.connect()))
let n = 0
const end = performance.now() + Number(process.env.MS ?? 3000)
await Promise.all(clients.map(async (c, i) => { while (performance.now() < end) { await c.query('SELECT v FROM items WHERE id = $1', [(n % 1000) + 1]); n++ } }))
console.log('q/s', Math.round(n / (Number(process.env.MS ?? 3000) / 1000)))
await Promise.all(clients.map((c) => c.end()))
const m = await (await fetch(`http://127.0.0.1:${PROXY}/metrics`)).text()
console.log(m.split('\n').filter((l) => /pinned_sessions_total|verifications_total|lends_total |prepared_again/.test(l) && !l.startsWith('#')).join('\n'))
await admin.end()
