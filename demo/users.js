// Signed-in users: each runs the same query with edgepg from this page, by token; Row-Level
// Security on the database decides which rows come back. No password is fetched or held here.
import { Client, httpSql } from '/dist/index.mjs'

const { host, port, database, users } = await (await fetch('/public.json')).json()
const QUERY = `SELECT c.name AS customer, o.id AS "order", o.status, o.ordered_at::date::text AS day
FROM orders o JOIN customers c ON c.id = o.customer_id ORDER BY o.id`
const wsProxy = () => `${location.origin.replace(/^http/, 'ws')}/net/0/v2`
const $ = (sel) => document.querySelector(sel)

/** The demo's sign-in: a token for `user` (your app gets it from its identity provider). */
const signIn = async (user) => (await (await fetch(`/signin?user=${user}`)).json()).token

async function ordersOf(user, transport) {
  const authToken = () => signIn(user)
  if (transport === 'http') return httpSql(`postgres://${host}:${port}/${database}`, { authToken, fetchEndpoint: `${location.origin}/net/0/sql` }).query(QUERY)
  const client = new Client({ host, port, database, authToken, wsProxy })
  client.on('error', () => {})
  try {
    await client.connect()
    return (await client.query(QUERY)).rows
  } finally {
    client.end().catch(() => {})
  }
}

function render(rows) {
  const table = document.createElement('table')
  const head = table.createTHead().insertRow()
  for (const name of ['customer', 'order', 'status', 'day']) head.appendChild(document.createElement('th')).textContent = name
  const body = table.createTBody()
  for (const row of rows) {
    const tr = body.insertRow()
    for (const name of ['customer', 'order', 'status', 'day']) tr.insertCell().textContent = String(row[name])
  }
  $('#rows').replaceChildren(table)
}

async function show(user) {
  const transport = $('#users').elements.transport.value
  $('#status').dataset.state = 'running'
  $('#status').textContent = `Signing in as ${users[user].name}…`
  $('#error').hidden = true
  const started = performance.now()
  try {
    const rows = await ordersOf(user, transport)
    const ms = Math.round(performance.now() - started)
    render(rows)
    for (const button of document.querySelectorAll('#people button')) button.setAttribute('aria-pressed', String(button.dataset.user === user))
    Object.assign($('#status').dataset, { state: 'done', user, ms })
    $('#status').textContent = `Signed in as ${users[user].name}: ${rows.length} orders, over ${transport === 'http' ? 'HTTP' : 'a WebSocket'}, in ${ms} ms (sign-in, login and query).`
  } catch (err) {
    $('#status').dataset.state = 'error'
    $('#error').hidden = false
    $('#error').textContent = `${err.code ? `${err.code}: ` : ''}${err.message}`
  }
}

for (const [id, { name }] of Object.entries(users)) {
  const button = $('#people').appendChild(document.createElement('button'))
  button.type = 'button'
  button.dataset.user = id
  button.setAttribute('aria-pressed', 'false')
  button.textContent = name
  button.addEventListener('click', () => show(id))
}
$('#users').dataset.ready = ''
